"""Benchmarks of the data path (issue 19; numbers in docs/data.md).

    python scripts/data_bench.py prepare --mb 64          # prepare vs the tokenizer's bare batch encode
    python scripts/data_bench.py loader                   # tokens/s from one loader process
    python scripts/data_bench.py memory --big-gb 2        # PSS of a loader and of a peer: 2 GB vs 20 MB of tokens
    python scripts/data_bench.py coverage --peers 4 --duration 150 --data DIR   # disjoint data, fault-free
    python scripts/data_bench.py coverage ... --chaos --fault-every 20            # the same under churn
    python scripts/data_bench.py coverage ... --manifest-only 2    # 2 of the peers hold only the manifest

`prepare` writes a corpus of ~1 MB text files (the Shakespeare corpus repeated, or --text), trains
a byte-level BPE on its first 8 MB, then times (a) the tokenizer's own `encode_batch` of the same
text in one process per core (each process reads its files, then is timed encoding them; the
slowest process is the bare time) and (b) `prepare` end to end (spawn, read, encode, write,
sha256, manifest). Target: prepare within 1.3x of the bare time.

`loader` and `memory` use token sets of random ids written straight into shards with a manifest
(the loader does not care how tokens were made): `memory` compares a loader reading 20,000
batches by pread (ours) and by np.memmap, on 20 MB and on --big-gb GB, and a real `p2pdiloco
join` peer training on each for --join-seconds.

`coverage` runs N real peers on a prepared directory (fault-free with LocalSwarm, or under
scripts/chaos.py's kills and kill+restarts), then reads every peer's `data` records (the cursor
ranges it read of each claimed shard) and counts, per epoch, the windows read twice or more and
the windows never read. Every epoch but the last one read is over (the swarm moved on), so its
never-read windows are the ones the claims lost. A killed peer's reads after its last record are
not counted: its successor reads them again from the published cursor, and they are counted once.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2pdiloco.data.manifest import FORMAT, MANIFEST, VERSION, copy_manifest  # noqa: E402

# --- prepare ------------------------------------------------------------------------------------

def write_corpus(out: Path, mb: float, text: Path) -> list[Path]:
    """~1 MB files, cut at line ends, from `text` repeated until mb MB are written."""
    src = text.read_bytes()
    out.mkdir(parents=True, exist_ok=True)
    files, written, at, n = [], 0, 0, 0
    while written < mb * 1e6:
        end = src.find(b"\n", at + 1_000_000)
        end = len(src) if end < 0 else end + 1
        path = out / f"part-{n:05d}.txt"
        path.write_bytes(src[at:end])
        files.append(path)
        written += end - at
        n += 1
        at = 0 if end >= len(src) else end
    return files


def _bare_encode(tok_json: str, paths: list[str], piece_bytes: int) -> tuple[int, int, float]:
    """(bytes, tokens, seconds encoding): the files read first, then encode_batch in 1 MB batches."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    texts = []
    for p in paths:
        data = Path(p).read_bytes()
        at = 0
        while at < len(data):
            cut = data.find(b"\n", at + piece_bytes)
            stop = len(data) if cut < 0 else cut + 1
            texts.append(data[at:stop].decode("utf-8", errors="replace"))
            at = stop
    per_batch = max(1, (1 << 20) // piece_bytes)
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), per_batch):
        tokens += sum(len(e.ids) for e in tok.encode_batch(texts[i:i + per_batch], add_special_tokens=False))
    return sum(len(t.encode()) for t in texts), tokens, time.perf_counter() - t0


def bench_prepare(args) -> dict:
    from p2pdiloco.data.corpus import default_corpus
    from p2pdiloco.data.prepare import piece_bytes_for, prepare
    from p2pdiloco.data.tokenizer import train_bpe

    workers = args.workers or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        tmp = Path(tmp)
        files = write_corpus(tmp / "text", args.mb, Path(args.text) if args.text else default_corpus())
        t0 = time.perf_counter()
        tok = train_bpe((p.read_text(errors="replace") for p in files[:8]), args.vocab)
        train_s = time.perf_counter() - t0
        (tmp / "tokenizer.json").write_text(tok.to_json())
        piece_bytes = piece_bytes_for(sum(p.stat().st_size for p in files), 0.01)  # as prepare cuts them
        shares = [[str(p) for p in files[i::workers]] for i in range(workers)]
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            bare = list(pool.map(_bare_encode, [tok.to_json()] * workers, shares, [piece_bytes] * workers))
        bare_s = max(s for _, _, s in bare)
        text_bytes = sum(b for b, _, _ in bare)
        bare_tokens = sum(t for _, t, _ in bare)
        t0 = time.perf_counter()
        manifest = prepare([str(tmp / "text")], tmp / "out", tokenizer=str(tmp / "tokenizer.json"), workers=workers,
                           shard_mb=args.shard_mb, progress=lambda _: None)
        prepare_s = time.perf_counter() - t0
        tokens = sum(s.tokens for s in manifest.train + manifest.val)
    mb = text_bytes / 1e6
    return {"bench": "prepare", "mb": round(mb, 1), "files": len(files), "workers": workers, "vocab": args.vocab,
            "tokenizer_train_s": round(train_s, 2), "bare_encode_s": round(bare_s, 2), "prepare_s": round(prepare_s, 2),
            "ratio": round(prepare_s / bare_s, 3),
            "bare_mb_s_per_core": round(mb / bare_s / workers, 2),
            "prepare_mb_s_per_core": round(mb / prepare_s / workers, 2),
            "bare_tokens_s_per_core": round(bare_tokens / bare_s / workers), "prepare_tokens_s_per_core":
                round(tokens / prepare_s / workers), "tokens": tokens, "bare_tokens": bare_tokens}


# --- synthetic token sets -----------------------------------------------------------------------

def make_token_set(out: Path, total_mb: float, *, shard_mb: float = 64, vocab: int = 8192, seed: int = 0) -> Path:
    """Shards of random uint16 ids (and a 2 MB held-out shard) with a manifest, as prepare writes them."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_shard = int(shard_mb * 1e6) // 2
    left = int(total_mb * 1e6) // 2
    shards = {"train": [], "val": []}
    i = 0
    while left > 0 or not shards["val"]:
        split = "train" if left > 0 else "val"
        n = min(per_shard, left) if split == "train" else 1_000_000
        ids = rng.integers(0, vocab, n, dtype=np.uint16)
        data = ids.tobytes()
        name = f"{split}-{i:05d}.bin"
        (out / name).write_bytes(data)
        shards[split].append({"file": name, "tokens": n, "max_id": int(ids.max()), "text_bytes": 4 * n,
                              "sha256": hashlib.sha256(data).hexdigest()})
        left -= n if split == "train" else 0
        i += 1
    manifest = {"format": FORMAT, "version": VERSION, "dtype": "uint16", "vocab_size": vocab, "eot_id": 0,
                "tokenizer": {"kind": "synthetic", "file": None, "sha256": "random ids"}, **shards}
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


def _loader(data: Path, block_size: int, mode: str):
    from p2pdiloco.data.loader import TokenData
    from p2pdiloco.data.manifest import read_manifest

    loader = TokenData(read_manifest(data), block_size=block_size, check=False, progress=lambda _: None)
    if mode == "mmap":  # the alternative we measured against: np.memmap and fancy indexing
        import torch

        maps = {}

        def read_windows(windows):
            rows = []
            for shard, k in windows:
                m = maps.get(shard.file)
                if m is None:
                    m = maps[shard.file] = np.memmap(data / shard.file, dtype=loader.dtype, mode="r")
                rows.append(np.asarray(m[k * block_size:k * block_size + block_size + 1]))
            chunk = torch.from_numpy(np.stack(rows).astype(np.int64))
            return chunk[:, :-1], chunk[:, 1:]

        loader.read_windows = read_windows
    return loader


def bench_loader(args) -> dict:
    import torch

    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        data = Path(args.data) if args.data else make_token_set(Path(tmp) / "tokens", args.mb)
        loader = _loader(data, args.block_size, "pread")
        g = torch.Generator().manual_seed(0)
        loader.train_batch(args.batch_size, g)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            loader.train_batch(args.batch_size, g)
            n += 1
        elapsed = time.perf_counter() - t0
    tokens_s = n * args.batch_size * args.block_size / elapsed
    return {"bench": "loader", "batch_size": args.batch_size, "block_size": args.block_size, "batches": n,
            "seconds": round(elapsed, 2), "tokens_per_s": round(tokens_s), "batch_ms": round(1e3 * elapsed / n, 3)}


def _pss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _read_child(args) -> dict:
    """In a child process: PSS before and after reading --batches batches."""
    import torch

    loader = _loader(Path(args.data), args.block_size, args.mode)
    g = torch.Generator().manual_seed(0)
    loader.train_batch(args.batch_size, g)
    before = _pss_mb()
    t0 = time.perf_counter()
    for _ in range(args.batches):
        loader.train_batch(args.batch_size, g)
    return {"pss_before_mb": round(before, 1), "pss_after_mb": round(_pss_mb(), 1),
            "read_s": round(time.perf_counter() - t0, 2)}


def _join_pss(data: Path, seconds: float, log_dir: Path) -> dict:
    """Peak PSS of a real `p2pdiloco join` trainer process training alone on `data`."""
    cmd = [sys.executable, "-m", "p2pdiloco", "join", "--config", str(ROOT / "peers/tiny-cpu.toml"), "--data",
           str(data), "--max-time", str(seconds), "--log-dir", str(log_dir), "--quiet", "--batch-size", "32",
           "--block-size", "256", "--inner-steps", "1000000"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0.0
    try:
        deadline = time.monotonic() + seconds + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                peak = max(peak, _pss_mb(proc.pid))
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    final = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if '"final"' in line]
    rec = final[-1] if final else {}
    return {"peak_pss_mb": round(peak, 1), "inner_steps": rec.get("inner_step"),
            "data_wait_pct": round(100 * rec.get("data_s", 0) / max(rec.get("compute_s", 1e-9), 1e-9), 3)}


def bench_memory(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        sets = {"small": make_token_set(Path(tmp) / "small", 20),
                "big": make_token_set(Path(tmp) / "big", args.big_gb * 1000)}
        for name, data in sets.items():
            for mode in ("pread", "mmap"):
                out = subprocess.run([sys.executable, __file__, "_read", "--data", str(data), "--mode", mode,
                                      "--batches", str(args.batches), "--batch-size", str(args.batch_size),
                                      "--block-size", str(args.block_size)],
                                     capture_output=True, text=True, timeout=600, check=True)
                rows.append({"set": name, "mode": mode, **json.loads(out.stdout.splitlines()[-1])})
            if args.join_seconds:
                joined = _join_pss(data, args.join_seconds, Path(tmp) / f"log-{name}")
                rows.append({"set": name, "mode": "join", **joined})
    by = {(r["set"], r["mode"]): r for r in rows}
    growth = {mode: by["big", mode]["pss_after_mb"] - by["small", mode]["pss_after_mb"] for mode in ("pread", "mmap")}
    result = {"bench": "memory", "big_gb": args.big_gb, "batches": args.batches, "rows": rows,
              **{f"loader_{mode}_growth_mb": round(g, 1) for mode, g in growth.items()}}
    if args.join_seconds:
        result["join_growth_mb"] = round(by["big", "join"]["peak_pss_mb"] - by["small", "join"]["peak_pss_mb"], 1)
    return result


# --- coverage -----------------------------------------------------------------------------------

def analyze_coverage(workdir: Path, data: Path, block_size: int) -> dict:
    """Per epoch: windows, read at least once, read twice or more, never read (from `data` records)."""
    from collections import defaultdict

    from p2pdiloco.data.manifest import read_manifest
    from p2pdiloco.metrics import read_metrics

    manifest = read_manifest(data)
    windows = {i: max(0, (s.tokens - 1) // block_size) for i, s in enumerate(manifest.train)}
    ranges = defaultdict(list)
    for path in sorted(workdir.glob("*/metrics.jsonl")):
        for r in read_metrics(path):
            if r.get("event") == "data":
                ranges[r["epoch"], r["shard"]].append((r["start"], r["end"]))
    epochs = sorted({e for e, _ in ranges})
    total = sum(windows.values())
    rows = []
    for e in epochs:
        read = twice = 0
        for shard, n in windows.items():
            count = np.zeros(n + 1, dtype=np.int64)
            for a, b in ranges.get((e, shard), []):
                count[a] += 1
                count[min(b, n)] -= 1
            per_window = np.cumsum(count)[:n]
            read += int((per_window >= 1).sum())
            twice += int((per_window >= 2).sum())
        rows.append({"epoch": e, "windows": total, "read": read, "read_twice": twice, "never": total - read,
                     "twice_pct": round(100 * twice / total, 3), "never_pct": round(100 * (total - read) / total, 3),
                     "over": e < epochs[-1]})
    over = [r for r in rows if r["over"]]
    # a killed peer's reads after its last record: at most one log interval of its windows, read
    # again by its successor and not counted above; bounded here from the peers' speeds
    rates, interval = [], 2.0
    for path in sorted(workdir.glob("*/metrics.jsonl")):
        rates += [r["tokens_per_s"] for r in read_metrics(path) if r.get("event") == "inner" and r.get("tokens_per_s")]
        conf = path.parent / "config.json"
        if conf.exists():
            interval = json.loads(conf.read_text()).get("log_interval", interval)
    chaos = workdir / "chaos.json"
    faults = json.loads(chaos.read_text())["faults"] if chaos.exists() else {}
    kills = faults.get("kill", 0) + faults.get("kill_restart", 0)
    unlogged = kills * float(np.median(rates) if rates else 0) * interval / block_size
    epochs_read = sum(r["read"] for r in rows) / max(total, 1)
    return {"epochs_read": round(epochs_read, 3), "shards": len(windows),
            "per_epoch": rows, "kills": kills, "unlogged_windows_bound": round(unlogged),
            "unlogged_pct_per_epoch_bound": round(100 * unlogged / max(total * epochs_read, 1), 3),
            "twice_pct_max": max((r["twice_pct"] for r in rows), default=None),
            "never_pct_max_over": max((r["never_pct"] for r in over), default=None)}


def _waits(workdir: Path) -> dict:
    """Per peer: data wait as % of compute (its last final or inner record), and its shard fetches."""
    from p2pdiloco.metrics import read_metrics

    out = {}
    for path in sorted(workdir.glob("*/metrics.jsonl")):
        records = list(read_metrics(path))
        last = next((r for r in reversed(records) if r.get("event") in ("final", "inner")), {})
        fetches = [r for r in records if r.get("event") == "fetch" and r.get("ok")]
        out[path.parent.name] = {
            "data_wait_pct": round(100 * last.get("data_s", 0) / max(last.get("compute_s") or 1e-9, 1e-9), 3),
            "fetches": len(fetches), "fetch_s": round(sum(r["seconds"] for r in fetches), 2),
            "fetch_mb": round(sum(sum(r["bytes"].values()) for r in fetches) / 1e6, 2)}
    return out


def bench_coverage(args) -> dict:
    from p2pdiloco.localswarm import LocalSwarm

    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    peer_args = ["--data", str(Path(args.data).resolve()), "--block-size", str(args.block_size), *args.peer_args]
    t0 = time.monotonic()
    if args.chaos:
        cmd = [sys.executable, str(ROOT / "scripts/chaos.py"), "--peers", str(args.peers), "--duration",
               str(args.duration), "--fault-every", str(args.fault_every), "--seed", str(args.seed), "--workdir",
               str(workdir), "--min-outer-steps", "0", "--", *peer_args]
        chaos = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=args.duration + 600)
        print(chaos.stdout[-3000:], file=sys.stderr)
    else:
        with LocalSwarm(workdir, config=args.config, extra_args=peer_args) as swarm:
            swarm.start("p0")
            for i in range(1, args.peers):
                own = []  # the last --manifest-only peers: the manifest, every shard fetched from the others
                if i >= args.peers - args.manifest_only:
                    copy = copy_manifest(args.data, workdir / f"p{i}-data")
                    own = ["--data", str(copy), "--shard-cache", str(workdir / f"p{i}-cache")]
                swarm.start(f"p{i}", *own, join="p0")
            swarm.wait_for(lambda: all(swarm.events(f"p{i}", "inner") for i in range(args.peers)), timeout=120,
                           what="every peer training")
            time.sleep(args.duration)
            swarm.stop_all(timeout=30)
    result = analyze_coverage(workdir, Path(args.data), args.block_size)
    result["per_peer"] = _waits(workdir)
    return {"bench": "coverage", "peers": args.peers, "duration": args.duration, "chaos": args.chaos,
            "manifest_only": args.manifest_only,
            "fault_every": args.fault_every if args.chaos else None, "wall_s": round(time.monotonic() - t0, 1),
            **result}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--mb", type=float, default=64)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--shard-mb", type=float, default=8)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--text", default="", help="Text to repeat (default: the Shakespeare corpus).")
    lo = sub.add_parser("loader")
    lo.add_argument("--data", default="", help="A prepared directory (default: 256 MB of random ids).")
    lo.add_argument("--mb", type=float, default=256)
    lo.add_argument("--seconds", type=float, default=5)
    me = sub.add_parser("memory")
    me.add_argument("--big-gb", type=float, default=2)
    me.add_argument("--batches", type=int, default=20000)
    me.add_argument("--join-seconds", type=float, default=30)
    co = sub.add_parser("coverage")
    co.add_argument("--data", required=True, help="A prepared directory.")
    co.add_argument("--peers", type=int, default=4)
    co.add_argument("--duration", type=float, default=150)
    co.add_argument("--chaos", action="store_true", help="Kills and kill+restarts by scripts/chaos.py.")
    co.add_argument("--manifest-only", type=int, default=0,
                    help="The last K peers hold only the manifest: they fetch every shard from the others.")
    co.add_argument("--fault-every", type=float, default=20)
    co.add_argument("--seed", type=int, default=1)
    co.add_argument("--config", default=str(ROOT / "peers/tiny-cpu.toml"))
    co.add_argument("--block-size", type=int, default=64)
    co.add_argument("--workdir", default="runs/coverage")
    co.add_argument("peer_args", nargs="*", help="More flags for every peer (after --).")
    rd = sub.add_parser("_read")
    rd.add_argument("--data", required=True)
    rd.add_argument("--mode", choices=["pread", "mmap"], default="pread")
    rd.add_argument("--batches", type=int, default=1000)
    for q in (lo, me, rd):
        q.add_argument("--batch-size", type=int, default=32)
        q.add_argument("--block-size", type=int, default=512)
    for q in (p, lo, me, co):
        q.add_argument("--tmp", default=None, help="Directory for the temporary corpus and shards.")
        q.add_argument("--out", default="", help="Also write the result JSON here.")
    args = parser.parse_args(argv)
    if args.bench == "coverage" and not (0 <= args.manifest_only < args.peers
                                         and not (args.manifest_only and args.chaos)):
        parser.error("--manifest-only must be below --peers (p0 holds the data), and not with --chaos")
    result = {"prepare": bench_prepare, "loader": bench_loader, "memory": bench_memory, "coverage": bench_coverage,
              "_read": _read_child}[
        args.bench](args)
    print(json.dumps(result))
    if getattr(args, "out", ""):
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
