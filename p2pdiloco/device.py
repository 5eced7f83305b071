"""Which torch device a peer trains on, with a one-line error for a CUDA device this machine lacks."""

from __future__ import annotations

import torch

from p2pdiloco.config import ConfigError


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        check_cuda(device, name)
    return device


def check_cuda(device: torch.device, name: str) -> None:
    """A ConfigError (one line, exit 2) for a CUDA device this machine does not have."""
    if not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else "torch sees no CUDA GPU (driver, CUDA_VISIBLE_DEVICES)")
        raise ConfigError(f"device {name!r}: {why} (torch {torch.__version__}): install a CUDA build of torch "
                          f"(https://pytorch.org/get-started) or pass --device cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(f"device {name!r}: this machine has {count} CUDA device{'s' * (count != 1)} "
                          f"(cuda:0{f' .. cuda:{count - 1}' if count > 1 else ''}): pick one of them or --device cpu")
