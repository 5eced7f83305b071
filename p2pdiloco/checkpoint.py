"""Checkpoints a peer can restart from: anchor, outer momentum, outer step, local weights, inner
AdamW state, counters and the resolved config.

A file is `MAGIC + sha256(payload) + payload` (payload = torch.save of a dict of tensors and plain
values, loaded with `weights_only=True`, so a checkpoint cannot run code). Writes go to a temp
file, are fsynced and renamed into place: a crash mid-write leaves the previous checkpoint intact.
The newest `keep` checkpoints are kept; loading falls back to the previous one when the newest is
truncated or corrupt. Writes and reads go in chunks under a byte progress bar (shown on a terminal
when they take more than a moment; see progress.py).

    >>> save_checkpoint(ckpt_dir, payload, outer_step=12)
    >>> payload, path, skipped = load_latest(ckpt_dir, cfg)   # (None, None, []) in an empty dir
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
from pathlib import Path
from typing import Optional

import torch

from p2pdiloco.progress import bar

logger = logging.getLogger(__name__)

MAGIC = b"P2PDLCK1"
NAME = re.compile(r"^ckpt-(\d{8})\.pt$")
CHUNK = 4 << 20  # bytes per write/read between progress-bar updates


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (corrupt, foreign, unwritable dir); the CLI exits 2."""


def checkpoint_paths(ckpt_dir: str | Path) -> list[Path]:
    """Checkpoints in a directory, newest (highest outer step) first."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def ensure_writable(ckpt_dir: str | Path) -> None:
    d = Path(ckpt_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"checkpoint dir {d} is not writable: {e.strerror or e}") from None


def save_checkpoint(ckpt_dir: str | Path, payload: dict, *, outer_step: int, keep: int = 2) -> Path:
    """Atomically write ckpt-<outer_step>.pt; on failure (disk full...) the older files stay."""
    d = Path(ckpt_dir)
    d.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(payload, buf)
    body = buf.getvalue()
    final = d / f"ckpt-{outer_step:08d}.pt"
    tmp = d / f"{final.name}.tmp"
    try:
        with open(tmp, "wb") as f, bar(f"p2pdiloco: writing {final.name}", total=len(body)) as b:
            f.write(MAGIC + hashlib.sha256(body).digest())
            view = memoryview(body)
            for start in range(0, len(view), CHUNK):
                b.update(f.write(view[start:start + CHUNK]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    for old in checkpoint_paths(d)[keep:]:
        old.unlink(missing_ok=True)
    return final


def read_checkpoint(path: str | Path) -> dict:
    """Read and verify one checkpoint file; CheckpointError says what is wrong with it."""
    path = Path(path)
    try:
        raw = _read_bytes(path)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    if len(raw) < len(MAGIC) + 32 or not raw.startswith(MAGIC):
        raise CheckpointError(f"{path} is not a p2pdiloco checkpoint")
    digest, body = raw[len(MAGIC):len(MAGIC) + 32], raw[len(MAGIC) + 32:]
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt (checksum mismatch)")
    try:
        payload = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a bad archive
        raise CheckpointError(f"checkpoint {path} cannot be decoded: {e}") from None
    if not isinstance(payload, dict) or "anchor" not in payload:
        raise CheckpointError(f"checkpoint {path} has no anchor")
    return payload


def _read_bytes(path: Path) -> bytearray:
    """The whole file, read in chunks under a byte progress bar."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        out = bytearray()
        with bar(f"p2pdiloco: reading {path.name}", total=size) as b:
            while chunk := f.read(CHUNK):
                out += chunk
                b.update(len(chunk))
    return out


def load_latest(ckpt_dir: str | Path, cfg) -> tuple[Optional[dict], Optional[Path], list[str]]:
    """The newest usable checkpoint of this run and model config.

    Returns (payload, path, problems): problems lists the newer files skipped as corrupt. A
    checkpoint of another run or model config is an error, not something to skip."""
    problems = []
    for path in checkpoint_paths(ckpt_dir):
        try:
            payload = read_checkpoint(path)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if payload.get("fingerprint") != cfg.fingerprint() or payload.get("run_id") != cfg.run_id:
            raise CheckpointError(
                f"checkpoint {path} belongs to run {payload.get('run_id')!r} with model fingerprint "
                f"{payload.get('fingerprint')!r}, not {cfg.run_id!r}/{cfg.fingerprint()}: use another --checkpoint-dir")
        return payload, path, problems
    if problems:
        raise CheckpointError("no usable checkpoint: " + "; ".join(problems))
    return None, None, problems
