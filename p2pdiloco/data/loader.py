"""Batches of token windows from a prepared directory, read straight from the shard files.

The sample space is every (shard, window): window k of a shard is its tokens
[k * block_size, k * block_size + block_size + 1), so each token is a target at most once per
pass: all but a shard's first and its last (tokens - 1) % block_size (under one window's worth).
A batch is `batch_size` windows read with `os.preadv` into one buffer.

Why not `np.memmap`: a mapping keeps every page the peer has touched in its resident set (and its
PSS), so a peer's memory would grow with the data it has read, up to the dataset's size; `pread`
reads through the kernel's page cache, which is shared, reclaimable and not counted against the
process (measured in docs/data.md, `scripts/data_bench.py memory`).

    >>> data = TokenData(read_manifest("data/books"), block_size=256)
    >>> x, y = data.train_batch(16, generator)        # int64 [16, 256] each
    >>> data.bits_per_byte(loss)                      # a loss in nats per token, in bits per text byte
"""

from __future__ import annotations

import logging
import math
import os
from typing import Optional

import numpy as np
import torch

from p2pdiloco.data import DataError
from p2pdiloco.data.manifest import Manifest, Shard, check_shard
from p2pdiloco.progress import note

logger = logging.getLogger(__name__)


class TokenData:
    """Train and held-out windows over a prepared directory; `train_batch` and `eval_batches` as ByteData."""

    def __init__(self, manifest: Manifest, *, block_size: int, check: bool = True, progress=note):
        self.manifest = manifest
        self.block_size = block_size
        self.dtype = manifest.dtype
        self.vocab_size = manifest.vocab_size
        self.bad: list[str] = []
        self._fds: dict[str, int] = {}
        train = self._usable(manifest.train, check, progress)
        val = self._usable(manifest.val, check, progress)
        self.train = [(s, (s.tokens - 1) // block_size) for s in train if s.tokens > block_size]
        self.val = [(s, (s.tokens - 1) // block_size) for s in val if s.tokens > block_size]
        if not self.train:
            raise DataError(f"{manifest.root}: no train shard holds a window of block_size + 1 = {block_size + 1} "
                            f"tokens")
        if not self.val:
            raise DataError(f"{manifest.root}: the held-out split holds no window of {block_size + 1} tokens: "
                            f"prepare with a larger --eval-fraction or use a smaller block_size")
        self.index = {s.file: i for i, s in enumerate(manifest.train)}  # a shard's place in the manifest
        self.order = None  # a ShardClaims: the swarm's disjoint order (set by the peer); None: random windows
        self._train_ends = np.cumsum([n for _, n in self.train])
        self._val_ends = np.cumsum([n for _, n in self.val])
        self.train_windows = int(self._train_ends[-1])

    def _usable(self, shards: list[Shard], check: bool, progress) -> list[Shard]:
        """The shards whose files are whole (size and sha256); each bad one is reported once, by name."""
        good = []
        for shard in shards:
            problem = check_shard(self.manifest, shard) if check else None
            if problem is None and not check and not (self.manifest.root / shard.file).is_file():
                problem = f"{shard.file} is missing"
            if problem:
                self.bad.append(shard.file)
                progress(f"p2pdiloco: not training on shard {problem}")
                continue
            good.append(shard)
        return good

    def _fd(self, shard: Shard) -> int:
        fd = self._fds.get(shard.file)
        if fd is None:
            fd = self._fds[shard.file] = os.open(self.manifest.root / shard.file, os.O_RDONLY)
        return fd

    def read_windows(self, windows: list[tuple[Shard, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) for the given (shard, window index) pairs."""
        span = self.block_size + 1
        buf = np.empty((len(windows), span), dtype=self.dtype)
        item = self.dtype.itemsize
        for row, (shard, k) in enumerate(windows):
            got = os.preadv(self._fd(shard), [memoryview(buf[row]).cast("B")], k * self.block_size * item)
            if got != span * item:
                raise OSError(f"{shard.file}: short read at window {k}")
        chunk = torch.from_numpy(buf.astype(np.int64))
        return chunk[:, :-1], chunk[:, 1:]

    def _window(self, ends: np.ndarray, shards: list, g: int) -> tuple[Shard, int]:
        i = int(np.searchsorted(ends, g, side="right"))
        return shards[i][0], g - (int(ends[i - 1]) if i else 0)

    def claimable(self) -> list[tuple[int, int]]:
        """(manifest index, windows) of every train shard this peer can read, for ShardClaims."""
        return [(self.index[s.file], n) for s, n in self.train]

    def train_batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The next windows of the claimed order, or windows drawn uniformly with the peer's generator."""
        if self.order is not None:
            shards = self.manifest.train
            return self.read_windows([(shards[i], k) for i, k in self.order.take(batch_size)])
        picks = torch.randint(0, self.train_windows, (batch_size,), generator=generator).tolist()
        return self.read_windows([self._window(self._train_ends, self.train, g) for g in picks])

    def eval_batches(self, batch_size: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed set of held-out batches, the same on every peer."""
        g = torch.Generator().manual_seed(1234)
        total = int(self._val_ends[-1])
        return [self.read_windows([self._window(self._val_ends, self.val, int(i))
                                   for i in torch.randint(0, total, (batch_size,), generator=g)])
                for _ in range(count)]

    def bits_per_byte(self, loss: float) -> Optional[float]:
        """A held-out loss (nats per token) in bits per byte of text, so that tokenizers compare."""
        return loss / math.log(2) / self.manifest.bytes_per_token()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
