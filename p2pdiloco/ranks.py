"""Several GPUs in one peer: `torchrun --nproc-per-node K -m p2pdiloco join ...`.

The K ranks train one local model with DistributedDataParallel (gradients all-reduced every
inner step, each rank reading its own batches), so they hold the same weights and the same AdamW
state. Only rank 0 talks to the swarm: it runs the DHT, the averager and the rounds, keeps the
anchor and the outer momentum, logs metrics and writes checkpoints. Once per inner step rank 0
broadcasts a few integers (stop?, weights changed?, the schedule position); when a round or a
resync moved its weights, it broadcasts them and the other ranks copy them.

    >>> ranks = Ranks.from_env()        # None outside torchrun (or with one process)
    >>> ranks.init(device)              # gloo on CPU, nccl on CUDA
    >>> ddp_model = ranks.wrap(model)   # starts from rank 0's weights
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from p2pdiloco.device import check_cuda
from p2pdiloco.model import flat_params, load_flat_


class Ranks:
    def __init__(self, rank: int, world_size: int, local_rank: int):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device = torch.device("cpu")
        self._started = False

    @classmethod
    def from_env(cls) -> Optional["Ranks"]:
        """The ranks torchrun describes in RANK/WORLD_SIZE/LOCAL_RANK; None for a single process."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return None
        return cls(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")))

    def pick_device(self, name: str) -> torch.device:
        """One GPU per rank (cuda:LOCAL_RANK) when there are GPUs and the config allows them."""
        if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
            return torch.device("cpu")
        device = torch.device("cuda", self.local_rank)
        check_cuda(device, f"{name} (rank {self.local_rank}: cuda:{self.local_rank})")
        return device

    def init(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        self._started = True

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)  # broadcasts rank 0's parameters and buffers

    def share_optimizer_state(self, opt: torch.optim.Optimizer, *, resumed: bool) -> None:
        """A rank 0 resumed from a checkpoint holds AdamW state the others lack: send it."""
        state = self.broadcast_object(opt.state_dict() if resumed and self.rank == 0 else None)
        if state is not None and self.rank != 0:
            opt.load_state_dict(state)

    def broadcast_object(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def control(self, values: list[int]) -> list[int]:
        """Rank 0's values, on every rank."""
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return [int(v) for v in t.tolist()]

    def broadcast_params(self, model: torch.nn.Module) -> None:
        flat = flat_params(model).to(self.device)
        dist.broadcast(flat, src=0)
        load_flat_(model, flat)

    def spread(self, model: torch.nn.Module) -> float:
        """Largest difference of any weight between two ranks (0.0 when they agree exactly)."""
        flat = flat_params(model).to(self.device)
        high, low = flat.clone(), flat.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        return float((high - low).max())

    def close(self) -> None:
        if self._started:
            self._started = False
            dist.destroy_process_group()
