#!/usr/bin/env python3
"""Where a peer's training thread spends its time: inner steps, waiting for data, round boundaries,
the rest, from real `p2pdiloco join` processes on loopback.

    python scripts/boundary_bench.py --size real --duration 420    # 3 small-gpu peers (88.6M) on this CPU
    python scripts/boundary_bench.py --size real --tree /tmp/old   # the same, running another checkout's code
    python scripts/boundary_bench.py --size tiny --duration 25     # the size the suite runs

Per peer and over the swarm: the training thread's time at each round boundary (the `boundary`
records: the snapshot, the weight corrections, the landing's bookkeeping; median and p95), its page
faults there (getrusage RUSAGE_THREAD), the off-step time per applied round for any version of the
code ((wall - inner steps - data wait) / rounds applied, from the `final` record), the page faults
of the whole training thread per applied round (read from /proc, steps included: comparable across
versions), the data wait as a share of the wall time, and the wall-time split.
Targets (issue: the GPU never waits): boundary median <= 100 ms and p95 <= 250 ms at 88.6M; data
wait <= 0.5% of the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2pdiloco.localswarm import LocalSwarm  # noqa: E402

SIZES = {
    # the 85M preset on this machine's CPU, as the issue tried it: a round every ~20-30 s
    "real": (str(ROOT / "peers" / "small-gpu.toml"),
             ["--device", "cpu", "--batch-size", "1", "--inner-steps", "3", "--threads", "1", "--eval-batches", "1",
              "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--log-interval", "10"]),
    "tiny": (str(ROOT / "peers" / "tiny-cpu.toml"), ["--inner-steps", "20", "--state-timeout", "5"]),
}


def thread_faults(pid: int) -> int | None:
    """Minor + major page faults of a process's main thread (the training thread of `p2pdiloco join`)."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[7]) + int(fields[9])  # minflt, majflt (fields 10 and 12 of stat)


def fmt(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def quantile(values: list, q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def peer_summary(events: list, faults: int | None) -> dict:
    final = next(r for r in events if r["event"] == "final")
    applied = sum(r["event"] == "outer" for r in events)
    bounds = [r for r in events if r["event"] == "boundary"]
    seconds = [r["boundary_s"] for r in bounds]
    off_step = final["wall_s"] - final["compute_s"] - final.get("data_s", 0.0)
    return {"rounds_applied": applied, "rounds_failed": sum(r["event"] == "round_failed" for r in events),
            "inner_steps": final["inner_step"], "wall_s": final["wall_s"],
            "boundary_ms_median": 1e3 * statistics.median(seconds) if seconds else None,
            "boundary_ms_p95": 1e3 * quantile(seconds, 0.95) if seconds else None,
            "boundary_ms_max": 1e3 * max(seconds) if seconds else None,
            "boundary_faults_median": statistics.median(r["faults"] for r in bounds) if bounds else None,
            # the parts: the snapshot, the eager preview's correction, the landing (its correction and bookkeeping)
            **{f"{part}_ms_median": 1e3 * statistics.median(r[f"{part}_s"] for r in bounds) if bounds else None
               for part in ("start", "preview", "finish")},
            "off_step_s_per_round": off_step / applied if applied else None,
            "thread_faults_per_round": faults / applied if faults is not None and applied else None,
            "data_wait_pct": 100 * final.get("data_s", 0.0) / final["wall_s"],
            "inner_steps_share": final["compute_s"] / final["wall_s"],
            "split": final.get("split"), "evals_background": final.get("evals"),
            "eval_background_s": final.get("eval_bg_s")}


def run(size: str, peers: int, duration: float, workdir: Path, *, tree: str = "", data: str = "") -> dict:
    preset, flags = SIZES[size]
    flags = [*flags, "--max-time", str(duration), *(["--data", data] if data else [])]
    env = None
    if tree:  # another checkout's p2pdiloco (the code before a change), with its own preset; `python -m`
        # puts the working directory first on the module path, so the peers run from there
        preset = str(Path(tree) / Path(preset).relative_to(ROOT))
        env = {"PYTHONPATH": tree}
        os.chdir(tree)
    names = [chr(ord("a") + i) for i in range(peers)]
    faults: dict[str, int | None] = {}
    with LocalSwarm(workdir, config=preset, extra_args=flags, env=env) as swarm:
        swarm.start(names[0])
        for name in names[1:]:
            swarm.start(name, join=names[0])
        deadline = time.monotonic() + duration + 300
        while time.monotonic() < deadline and any(swarm.peers[n].proc.poll() is None for n in names):
            for n in names:  # the last reading before the process exits
                value = thread_faults(swarm.peers[n].proc.pid)
                if value is not None:
                    faults[n] = value
            time.sleep(1.0)
        codes = {n: swarm.wait_exit(n, timeout=30) for n in names}
        per_peer = {n: peer_summary(swarm.events(n), faults.get(n)) for n in names if codes[n] == 0}
    bounds = [r["boundary_s"] for n in per_peer for r in swarm.events(n, "boundary")]

    def values(key: str) -> list:
        return [p[key] for p in per_peer.values() if p[key] is not None]

    result = {"size": size, "peers": peers, "duration": duration, "tree": tree or str(ROOT), "exit_codes": codes,
              "per_peer": per_peer,
              "boundary_ms_median": 1e3 * statistics.median(bounds) if bounds else None,
              "boundary_ms_p95": 1e3 * quantile(bounds, 0.95) if bounds else None,
              "off_step_s_per_round": values("off_step_s_per_round"),
              "thread_faults_per_round": values("thread_faults_per_round"),
              "data_wait_pct": values("data_wait_pct"), "inner_steps_share": values("inner_steps_share")}
    if bounds:
        result["met"] = {"boundary_median_le_100ms": result["boundary_ms_median"] <= 100,
                         "boundary_p95_le_250ms": result["boundary_ms_p95"] <= 250,
                         "data_wait_le_0.5pct": all(v <= 0.5 for v in result["data_wait_pct"])}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--duration", type=float, default=25.0, help="seconds each peer trains")
    parser.add_argument("--tree", default="", help="run the peers from this checkout of p2pdiloco instead")
    parser.add_argument("--data", default="", help="a corpus or prepared token directory (default: the preset's)")
    parser.add_argument("--out", default="", help="write the result here as JSON")
    args = parser.parse_args()
    out = Path(args.out).resolve() if args.out else None  # before run() moves to another --tree
    with tempfile.TemporaryDirectory(prefix="boundary-") as tmp:
        result = run(args.size, args.peers, args.duration, Path(tmp), tree=args.tree, data=args.data)
    print(f"{'peer':4s} {'rounds':>6s} {'bound. ms med':>13s} {'p95':>7s} {'faults/bd':>9s} {'off-step s/round':>16s} "
          f"{'faults/round':>12s} {'data %':>7s} {'in steps':>8s}")
    for name, p in result["per_peer"].items():
        cells = [fmt(p[k]) for k in ("boundary_ms_median", "boundary_ms_p95", "boundary_faults_median",
                                     "off_step_s_per_round", "thread_faults_per_round", "data_wait_pct",
                                     "inner_steps_share")]
        widths = (13, 7, 9, 16, 12, 7, 8)
        print(f"{name:4s} {p['rounds_applied']:6d} " + " ".join(f"{c:>{w}s}" for c, w in zip(cells, widths)))
    print(f"all: boundary median {fmt(result['boundary_ms_median'])} ms, p95 {fmt(result['boundary_ms_p95'])} ms; "
          f"met: {result.get('met')}")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "per_peer"}))
    sys.exit(0 if all(code == 0 for code in result["exit_codes"].values()) else 1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
