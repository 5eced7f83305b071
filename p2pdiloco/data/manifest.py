"""The manifest of a prepared token directory: what `prepare` wrote and what `join --data` reads.

`manifest.json` names the tokenizer (its file beside the shards and that file's sha256), the
token dtype, the vocabulary, the end-of-text id, and per shard its file, token count, largest
token id and sha256, for the train split and the held-out split apart. Its own hash (`digest`)
goes into the run's fingerprint, so that peers of one run train on the same tokens.

    {"format": "p2pdiloco-tokens", "version": 1, "dtype": "uint16", "vocab_size": 4096, "eot_id": 0,
     "tokenizer": {"kind": "hf", "file": "tokenizer.json", "sha256": "..."},
     "train": [{"file": "train-00000.bin", "tokens": 1048576, "max_id": 4095, "sha256": "...",
                "text_bytes": 4194304}, ...],
     "val": [...], "inputs": [...], "options": {...}}
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from p2pdiloco.data import DataError

FORMAT = "p2pdiloco-tokens"
VERSION = 1
MANIFEST = "manifest.json"


class ManifestError(DataError):
    """A prepared directory that cannot be trained on; the CLI reports it on one line."""


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65536 else "uint32"


@dataclass(frozen=True)
class Shard:
    file: str
    tokens: int
    max_id: int
    sha256: str
    text_bytes: int


@dataclass
class Manifest:
    root: Path
    raw: dict

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.raw["dtype"])

    @property
    def vocab_size(self) -> int:
        return int(self.raw["vocab_size"])

    @property
    def eot_id(self) -> int:
        return int(self.raw["eot_id"])

    @property
    def train(self) -> list[Shard]:
        return [Shard(**s) for s in self.raw["train"]]

    @property
    def val(self) -> list[Shard]:
        return [Shard(**s) for s in self.raw["val"]]

    @property
    def digest(self) -> str:
        """sha256 of the manifest's content: the shards' hashes, the tokenizer's, dtype and vocab."""
        keep = {k: self.raw[k] for k in ("format", "version", "dtype", "vocab_size", "eot_id", "tokenizer",
                                         "train", "val")}
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()

    def tokenizer_text(self) -> Optional[str]:
        name = self.raw["tokenizer"].get("file")
        if not name:
            return None
        try:
            return (self.root / name).read_text()
        except OSError as e:
            raise ManifestError(f"{self.root}: cannot read the tokenizer {name}: {e.strerror or e}") from None

    def bytes_per_token(self) -> float:
        """Mean text bytes per token of the held-out split (EOT counted as a token): loss to bits per byte."""
        tokens = sum(s.tokens for s in self.val)
        return sum(s.text_bytes for s in self.val) / max(tokens, 1)


def is_prepared(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | Path) -> Manifest:
    """The manifest of a prepared directory, checked for shape (not the shards' bytes)."""
    root = Path(path)
    file = root / MANIFEST
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{root} holds no {MANIFEST}: prepare it with `p2pdiloco prepare INPUT --out "
                            f"{root}`") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError(f"cannot read {file}: {getattr(e, 'strerror', None) or e}") from None
    except ValueError as e:
        raise ManifestError(f"{file} is not JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else None
        raise ManifestError(f"{file} is not a p2pdiloco token manifest (format {found!r})")
    if raw.get("version") != VERSION:
        raise ManifestError(f"{file} has manifest version {raw.get('version')!r}; this p2pdiloco reads {VERSION}")
    try:
        manifest = Manifest(root, raw)
        if manifest.dtype not in (np.uint16, np.uint32) or manifest.vocab_size < 2:
            raise ValueError("dtype or vocab_size")
        shards = manifest.train + manifest.val
        if not manifest.train or not manifest.val:
            raise ValueError("no train or no held-out shards")
        for s in shards:
            if Path(s.file).name != s.file or s.tokens < 0 or s.max_id < 0:
                raise ValueError(f"shard {s.file!r}")
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{file} is malformed ({e})") from None
    top = max(s.max_id for s in shards)
    if top >= manifest.vocab_size:
        raise ManifestError(f"{file}: token id {top} is not below the vocabulary size {manifest.vocab_size}")
    return manifest


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_shard(manifest: Manifest, shard: Shard, path: Optional[Path] = None) -> Optional[str]:
    """None when the shard's file (in the prepared directory, or `path`) is whole (size and sha256
    as the manifest says), else why not."""
    path = manifest.root / shard.file if path is None else path
    try:
        size = path.stat().st_size
        if size != shard.tokens * manifest.dtype.itemsize:
            return f"{shard.file} holds {size} bytes, the manifest says {shard.tokens * manifest.dtype.itemsize}"
        if file_sha256(path) != shard.sha256:
            return f"{shard.file} does not match its sha256 in the manifest"
    except OSError as e:
        return f"{shard.file}: {e.strerror or e}"
    return None


def copy_manifest(root: str | Path, dest: str | Path) -> Path:
    """What a volunteer needs of a prepared directory: its manifest and tokenizer file, no shard
    (data/fetch.py fetches the shards from peers). Returns dest."""
    root, dest = Path(root), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = json.loads((root / MANIFEST).read_text())["tokenizer"].get("file")
    for name in filter(None, (MANIFEST, tokenizer)):
        (dest / name).write_bytes((root / name).read_bytes())
    return dest

