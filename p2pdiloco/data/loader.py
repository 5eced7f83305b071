"""Batches of token windows from a prepared directory, read straight from the shard files.

The sample space is every (shard, window): window k of a shard is its tokens
[k * block_size, k * block_size + block_size + 1), so each token is a target at most once per
pass: all but a shard's first and its last (tokens - 1) % block_size (under one window's worth).
A batch is `batch_size` windows read with `os.preadv` into one buffer.

A shard is read from the prepared directory or from the cache of shards fetched from peers
(fetch.py). With `fetch`, a shard in neither place is not an error: the peer claims it only once
it holds it (`paths` are the shards here; `add` and `forget` follow the cache).

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
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from p2pdiloco.data import DataError
from p2pdiloco.data.manifest import Manifest, Shard, check_shard
from p2pdiloco.progress import note

logger = logging.getLogger(__name__)


class TokenData:
    """Train and held-out windows over a prepared directory; `train_batch` and `eval_batches` as ByteData."""

    def __init__(self, manifest: Manifest, *, block_size: int, check: bool = True, progress=note,
                 cache: Optional[str | Path] = None, fetch: bool = False):
        self.manifest = manifest
        self.block_size = block_size
        self.dtype = manifest.dtype
        self.vocab_size = manifest.vocab_size
        self.cache = Path(cache) if cache else None
        self.fetch = fetch
        self.bad: list[str] = []
        self.paths: dict[str, Path] = {}  # the shards here, whole
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
        # random windows (data_order = random, the other ranks of a torchrun peer): the shards here
        self._random = [(s, n) for s, n in self.train if s.file in self.paths]
        self._train_ends = np.cumsum([n for _, n in self._random]) if self._random else np.zeros(1, dtype=np.int64)
        self._val_ends = np.cumsum([n for _, n in self.val])
        self.train_windows = int(self._train_ends[-1])

    def _usable(self, shards: list[Shard], check: bool, progress) -> list[Shard]:
        """The shards whose files are whole (size and sha256), here or in the cache; each bad one is
        reported once, by name. With `fetch`, the others too: they can come from peers."""
        good = []
        for shard in shards:
            places = [self.manifest.root / shard.file] + ([self.cache / shard.file] if self.cache else [])
            problems = []
            for path in places:
                if not path.is_file():
                    continue
                problem = check_shard(self.manifest, shard, path) if check else None
                if problem is None:
                    self.paths[shard.file] = path
                    break
                problems.append(problem)
            if shard.file not in self.paths:
                if problems or not self.fetch:
                    self.bad.append(shard.file)
                    why = problems[0] if problems else f"{shard.file} is missing"
                    progress(f"p2pdiloco: not training on shard {why}" + (" (fetching it from peers instead)"
                                                                          if self.fetch else ""))
                if not self.fetch:
                    continue
            good.append(shard)
        return good

    def add(self, name: str, path: Path) -> None:
        """A shard fetched into the cache (whole, checked)."""
        self.paths[name] = path

    def forget(self, name: str) -> None:
        """A shard the cache let go."""
        fd = self._fds.pop(name, None)
        if fd is not None:
            os.close(fd)
        self.paths.pop(name, None)

    def reading(self) -> list[str]:
        """The shards the claimed order reads now (the cache keeps them)."""
        slots = self.order.slots if self.order is not None else []
        return [self.manifest.train[s.shard].file for s in slots]

    def missing(self, split: str = "val") -> list[Shard]:
        return [s for s, _ in getattr(self, split) if s.file not in self.paths]

    def _fd(self, shard: Shard) -> int:
        fd = self._fds.get(shard.file)
        if fd is None:
            path = self.paths.get(shard.file)
            if path is None:
                raise DataError(f"shard {shard.file} is not here (it is fetched from peers before it is read)")
            fd = self._fds[shard.file] = os.open(path, os.O_RDONLY)
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
        if not self._random:
            raise DataError(f"{self.manifest.root}: no train shard is here, and windows drawn at random are read from "
                            f"local shards only (data_order = claims fetches shards from peers)")
        picks = torch.randint(0, self.train_windows, (batch_size,), generator=generator).tolist()
        return self.read_windows([self._window(self._train_ends, self._random, g) for g in picks])

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
