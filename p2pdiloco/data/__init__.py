"""The data a peer trains on: bytes of a text file (corpus.py) or a directory of token shards made
by `p2pdiloco prepare` (prepare.py, tokenizer.py, sources.py; read by loader.py through the
manifest, manifest.py). `load_data` picks by what `cfg.data` is. torch is imported only by the
loaders, so that `prepare` and its worker processes start without it.

    >>> data = load_data(cfg)                  # ByteData or TokenData
    >>> x, y = data.train_batch(cfg.batch_size, generator)
    >>> batches = data.eval_batches(cfg.batch_size, cfg.eval_batches)   # the same on every peer
"""

from __future__ import annotations

import importlib
from pathlib import Path


class DataError(ValueError):
    """Data that cannot be read or trained on; the CLI reports it on one line (exit 2)."""


from p2pdiloco.data.manifest import ManifestError, is_prepared, read_manifest  # noqa: E402  (needs DataError)
from p2pdiloco.progress import note  # noqa: E402

_LAZY = {"ByteData": "corpus", "default_corpus": "corpus", "pip_progress": "corpus", "read_text_bytes": "corpus",
         "TokenData": "loader"}
__all__ = ["DataError", "ManifestError", "data_path", "is_prepared", "load_data", "read_manifest", *_LAZY]


def data_path(data: str, progress=note) -> str:
    """`data` itself, or the prepared directory of a built-in dataset's name (prepared on first use)."""
    from p2pdiloco.data.builtin import is_builtin, resolve

    return str(resolve(data, progress)) if is_builtin(data) and not Path(data).exists() else data


def load_data(cfg, progress=note):
    """The train and held-out data `cfg.data` names (the default corpus when empty)."""
    from p2pdiloco.data.corpus import ByteData, default_corpus, read_text_bytes
    from p2pdiloco.data.loader import TokenData

    data = data_path(cfg.data, progress)
    if data and is_prepared(data):
        return TokenData(read_manifest(data), block_size=cfg.block_size, progress=progress,
                         cache=cfg.shard_cache_dir, fetch=cfg.data_order == "claims")
    path = Path(cfg.data) if cfg.data else default_corpus(progress)
    if cfg.data and not path.exists():
        raise DataError(f"data path does not exist: {path}")
    return ByteData(read_text_bytes(path), block_size=cfg.block_size, eval_fraction=cfg.eval_fraction)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"p2pdiloco.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'p2pdiloco.data' has no attribute {name!r}")
