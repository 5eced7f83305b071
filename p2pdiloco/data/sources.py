"""The inputs of `p2pdiloco prepare`, cut into units of work (one unit = one shard).

Inputs are text files (.txt, .md; one document per file), JSON lines (`--text-key`, one
document per line), parquet files (a text column) and `datasets` datasets saved on disk
(`save_to_disk`), given as files or directories (searched recursively, sorted). A unit is a byte
range of a text or JSONL file cut at line starts, a range of parquet row groups, or a range of a
dataset's rows: units are planned from sizes alone, so that workers read them in parallel and a
re-run knows which shards it already wrote.

A unit yields pieces: (text, position, document end), a piece being a document or, in a text
file, a run of lines of about `piece_bytes`. The position is the piece's offset in the
concatenated input bytes (estimated for parquet and datasets): prepare.py holds a piece out by a
stable hash of it, so a re-run holds out the same text.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from p2pdiloco.data import DataError

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".ndjson")


class SourceError(DataError):
    """An input that cannot be read as text; the CLI reports it on one line."""


@dataclass(frozen=True)
class Source:
    kind: str  # text | jsonl | parquet | dataset
    path: str
    size: int  # bytes of text (estimated for parquet and datasets)
    rows: int = 0  # parquet row groups, dataset rows


@dataclass(frozen=True)
class Unit:
    index: int
    kind: str
    path: str
    start: int  # byte offset (text, jsonl), row group (parquet) or row (dataset)
    end: int
    position: int  # offset of the unit's first byte in the concatenated input


def _is_dataset_dir(path: Path) -> bool:
    """A `save_to_disk` directory: of a Dataset, or of a DatasetDict (whose train split is read)."""
    return ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()) or (
        path / "dataset_dict.json").is_file()


def find_sources(inputs: list[str], text_key: str) -> list[Source]:
    """Every readable input under the given paths, in a stable order."""
    sources: list[Source] = []
    for raw in inputs:
        path = Path(raw).expanduser()
        try:
            exists, is_dir = path.exists(), path.is_dir()
        except OSError as e:  # a parent directory we may not search
            raise SourceError(f"cannot read {raw}: {e.strerror or e}") from None
        if not exists:
            raise SourceError(f"input {raw} does not exist")
        if is_dir and _is_dataset_dir(path):
            sources.append(_dataset_source(path, text_key))
        elif path.is_dir():
            marks = [*path.rglob("state.json"), *path.rglob("dataset_dict.json")]
            found = sorted({p.parent for p in marks if _is_dataset_dir(p.parent)})
            dataset_dirs = [d for d in found if not any(o in d.parents for o in found)]  # a dict's splits: once
            for p in sorted(path.rglob("*")):
                if any(d in p.parents for d in dataset_dirs):
                    continue
                if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES + (".parquet",):
                    sources.append(_file_source(p, text_key))
            sources.extend(_dataset_source(d, text_key) for d in dataset_dirs)
        else:
            sources.append(_file_source(path, text_key))
    if not sources:
        raise SourceError(f"no inputs found under {', '.join(inputs)} (.txt, .md, .jsonl, .parquet or a "
                          f"dataset saved with save_to_disk)")
    if sum(s.size for s in sources) == 0:
        raise SourceError(f"the inputs ({', '.join(inputs)}) hold no text")
    return sources


def _file_source(path: Path, text_key: str) -> Source:
    suffix = path.suffix.lower()
    try:
        size = path.stat().st_size
        if suffix == ".parquet":
            meta = _parquet(path).metadata
            column = _parquet_column(meta.schema.to_arrow_schema(), text_key, path)
            size = sum(meta.row_group(g).column(column).total_uncompressed_size for g in range(meta.num_row_groups))
            return Source("parquet", str(path), size, meta.num_row_groups)
        with open(path, "rb"):  # unreadable files fail here, not in a worker
            pass
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror or e}") from None
    return Source("jsonl" if suffix in JSONL_SUFFIXES else "text", str(path), size)


def _parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SourceError(f"{path}: reading parquet needs pyarrow: pip install 'p2pdiloco[data]'") from None
    try:
        return pq.ParquetFile(str(path))
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise SourceError(f"cannot read parquet {path}: {str(e).splitlines()[0]}") from None


def _parquet_column(schema, text_key: str, path) -> int:
    if text_key not in schema.names:
        raise SourceError(f"{path} has no column {text_key!r} (columns: {', '.join(schema.names)}); "
                          f"pass --text-key")
    return schema.names.index(text_key)


def _dataset(path: str):
    try:
        import datasets
    except ImportError:
        raise SourceError(f"{path}: reading a saved dataset needs the datasets package: "
                          f"pip install datasets") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise SourceError(f"cannot read dataset {path}: {str(e).splitlines()[0]}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise SourceError(f"dataset {path} has splits {', '.join(ds)} and no 'train'")
        ds = ds["train"]
    return ds


def _dataset_source(path: Path, text_key: str) -> Source:
    ds = _dataset(str(path))
    if text_key not in ds.column_names:
        raise SourceError(f"dataset {path} has no column {text_key!r} (columns: {', '.join(ds.column_names)}); "
                          f"pass --text-key")
    split = path / "train" if (path / "dataset_dict.json").is_file() else path
    size = sum(f.stat().st_size for f in split.rglob("*.arrow"))
    return Source("dataset", str(path), size, len(ds))


def plan_units(sources: list[Source], shard_bytes: int) -> list[Unit]:
    """Cut the sources into units of about shard_bytes of text each."""
    units: list[Unit] = []
    position = 0
    for src in sources:
        if src.kind in ("text", "jsonl"):
            n = max(1, math.ceil(src.size / shard_bytes))
            bounds = [src.size * i // n for i in range(n + 1)]
            pieces = [(bounds[i], bounds[i + 1], bounds[i]) for i in range(n)]
        else:
            count = src.rows
            n = max(1, min(count, math.ceil(src.size / shard_bytes)))
            bounds = [count * i // n for i in range(n + 1)]
            pieces = [(bounds[i], bounds[i + 1], src.size * bounds[i] // max(count, 1)) for i in range(n)]
        for start, end, offset in pieces:
            units.append(Unit(len(units), src.kind, src.path, start, end, position + offset))
        position += src.size
    return units


def read_unit(unit: Unit, text_key: str, piece_bytes: int) -> Iterator[tuple[str, int, bool]]:
    """The unit's pieces: (text, position, whether a document ends with it)."""
    if unit.kind == "text":
        yield from _text_pieces(unit, piece_bytes)
    elif unit.kind == "jsonl":
        yield from _jsonl_pieces(unit, text_key)
    elif unit.kind == "parquet":
        yield from _rows_pieces(unit, _parquet_rows(unit, text_key))
    else:
        ds = _dataset(unit.path)
        yield from _rows_pieces(unit, (ds[i][text_key] for i in range(unit.start, unit.end)))


def _line_bytes(path: str, start: int, end: int) -> tuple[int, int, bytes]:
    """(offset of the first line, file size, the lines that start in [start, end)): a line that
    starts before `end` is read to its end; one that starts before `start` belongs to the unit before."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if start > 0:
                f.seek(start - 1)
                if f.read(1) != b"\n":
                    f.readline()
                start = f.tell()
            if start >= end:
                return start, size, b""
            f.seek(start)
            data = f.read(end - start)
            if end < size and not data.endswith(b"\n"):
                data += f.readline()
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror or e}") from None
    return start, size, data


def _text_pieces(unit: Unit, piece_bytes: int) -> Iterator[tuple[str, int, bool]]:
    first, size, data = _line_bytes(unit.path, unit.start, unit.end)
    base = unit.position - unit.start + first
    at = 0
    while at < len(data):
        cut = data.find(b"\n", at + piece_bytes)
        stop = len(data) if cut < 0 else cut + 1
        yield (data[at:stop].decode("utf-8", errors="replace"), base + at,
               stop >= len(data) and first + len(data) >= size)
        at = stop


def _jsonl_pieces(unit: Unit, text_key: str) -> Iterator[tuple[str, int, bool]]:
    first, _, data = _line_bytes(unit.path, unit.start, unit.end)
    base = unit.position - unit.start + first
    at = 0
    for line in data.splitlines(keepends=True):
        if line.strip():
            try:
                text = json.loads(line)[text_key]
            except (ValueError, TypeError, KeyError):
                line_no = data[:at].count(b"\n") + 1
                raise SourceError(f"{unit.path}: line {line_no} of the unit at byte {first} is not a JSON "
                                  f"object with a {text_key!r} string (pass --text-key)") from None
            if not isinstance(text, str):
                raise SourceError(f"{unit.path}: {text_key!r} is a {type(text).__name__}, not a string")
            yield text, base + at, True
        at += len(line)


def _parquet_rows(unit: Unit, text_key: str) -> Iterator[str]:
    pf = _parquet(Path(unit.path))
    column = _parquet_column(pf.schema_arrow, text_key, unit.path)
    for group in range(unit.start, unit.end):
        yield from pf.read_row_group(group, columns=[pf.schema_arrow.names[column]]).column(0).to_pylist()


def _rows_pieces(unit: Unit, rows: Iterator[str]) -> Iterator[tuple[str, int, bool]]:
    position = unit.position
    for text in rows:
        if text is None:
            continue
        if not isinstance(text, str):
            raise SourceError(f"{unit.path}: the text column holds a {type(text).__name__}, not strings")
        yield text, position, True
        position += len(text)
