"""The outer state a peer shares with joiners, and its download.

Shared state = (metadata, [anchor, momentum]): metadata holds `outer_step`, the config
`fingerprint` and `run_id`. A joiner keeps `allow_state_sharing=False` until it has loaded, so it
never advertises its random init; peers advertise `state_sharing_priority = outer_step`, so
hivemind downloads from the most advanced peer first.

    >>> state = download_state(averager, cfg, numel, timeout=30)   # None if nobody shares state
    >>> state.outer_step, state.anchor, state.momentum
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

logger = logging.getLogger(__name__)


@dataclass
class OuterState:
    outer_step: int
    anchor: torch.Tensor
    momentum: torch.Tensor
    download_s: float = 0.0


def make_metadata(cfg, outer_step: int) -> dict:
    return {"outer_step": int(outer_step), "fingerprint": cfg.fingerprint(), "run_id": cfg.run_id}


def validate_state(metadata, tensors, cfg, numel: int) -> OuterState:
    """Check a downloaded state; raise ValueError with the reason if it is not usable."""
    if not isinstance(metadata, dict):
        raise ValueError("metadata is not a dict")
    if metadata.get("fingerprint") != cfg.fingerprint() or metadata.get("run_id") != cfg.run_id:
        raise ValueError(f"state is from another run or model config ({metadata.get('run_id')!r}, "
                         f"{metadata.get('fingerprint')!r})")
    outer_step = metadata.get("outer_step")
    if not isinstance(outer_step, int) or outer_step < 0:
        raise ValueError(f"bad outer_step {outer_step!r}")
    if len(tensors) != 2:
        raise ValueError(f"expected 2 tensors (anchor, momentum), got {len(tensors)}")
    anchor, momentum = (t.detach().float().reshape(-1) for t in tensors)
    for name, t in (("anchor", anchor), ("momentum", momentum)):
        if t.numel() != numel:
            raise ValueError(f"{name} has {t.numel()} values, the model {numel}")
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} is not finite")
    return OuterState(outer_step=outer_step, anchor=anchor.clone(), momentum=momentum.clone())


def download_state(averager, cfg, numel: int, *, timeout: float, progress=None,
                   stop_event=None) -> Optional[OuterState]:
    """Download the outer state from the most advanced peer that shares it, retrying until `timeout`.
    Returns None if no peer shared a usable state in time."""
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        attempt += 1
        t0 = time.monotonic()
        try:
            result = averager.load_state_from_peers(timeout=max(1.0, min(cfg.state_timeout, deadline - t0)))
        except Exception as e:  # a timeout or a broken stream: try again while time is left
            logger.info(f"state download attempt {attempt} failed: {e!r}")
            result = None
        if result is not None:
            metadata, tensors = result
            try:
                state = validate_state(metadata, tensors, cfg, numel)
                state.download_s = time.monotonic() - t0
                return state
            except ValueError as e:
                logger.warning(f"rejected a downloaded state: {e}")
        if time.monotonic() + 1.0 >= deadline or (stop_event is not None and stop_event.is_set()):
            return None
        if progress is not None and attempt == 1:
            progress("p2pdiloco: no peer shares state yet, retrying ...")
        time.sleep(1.0)
