#!/usr/bin/env python3
"""Run a local swarm of real `p2pdiloco join` peers on loopback and show the loss falling.

    python scripts/demo.py                       # 3 peers, tiny-cpu preset, 150 s
    python scripts/demo.py --peers 4 --duration 300 --workdir runs/demo

Peer a starts the swarm and writes its multiaddrs; the others join through a's address. Every
15 s it prints each peer's outer step and loss; at the end, the numbers the README quotes:
round time, rounds per minute, tokens/s per peer and the eval loss curve.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pdiloco.localswarm import LocalSwarm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def summarize(swarm: LocalSwarm, names: list[str]) -> dict:
    summary = {}
    for name in names:
        outer = swarm.events(name, "outer")
        inner = swarm.events(name, "inner")
        failed = swarm.events(name, "round_failed")
        span = (outer[-1]["time"] - outer[0]["time"]) if len(outer) > 1 else 0.0
        summary[name] = {
            "outer_steps": len(outer),
            "rounds_failed": len(failed),
            "round_s": statistics.median(r["round_s"] for r in outer) if outer else None,
            "rounds_per_min": 60 * (len(outer) - 1) / span if span else None,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in inner[1:]) if len(inner) > 1 else None,
            "first_loss": inner[0]["loss"] if inner else None,
            "last_loss": inner[-1]["loss"] if inner else None,
            "eval_curve": [(r["outer_step"], round(r["eval_loss"], 3)) for r in outer if r["eval_loss"] is not None],
            "group_sizes": sorted({r["group_size"] for r in outer}),
        }
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--duration", type=float, default=150.0, help="seconds of training")
    parser.add_argument("--config", default=str(ROOT / "peers" / "tiny-cpu.toml"))
    parser.add_argument("--workdir", default="", help="where logs go (default: a temporary directory)")
    parser.add_argument("--print-every", type=float, default=15.0)
    parser.add_argument("extra", nargs="*", help="extra flags for every peer, after --")
    args = parser.parse_args()
    if args.peers < 1:
        parser.error("--peers must be >= 1")

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="p2pdiloco-demo-"))
    names = [chr(ord("a") + i) for i in range(args.peers)]
    print(f"demo: {args.peers} peers, {args.duration:.0f} s, logs in {workdir}", flush=True)
    with LocalSwarm(workdir, config=args.config, extra_args=args.extra) as swarm:
        swarm.start(names[0], "--max-time", str(args.duration))
        print(f"demo: peer a listens at {swarm.maddr(names[0])}", flush=True)
        for name in names[1:]:
            swarm.start(name, "--max-time", str(args.duration), join=names[0])
        t0 = time.monotonic()
        deadline = t0 + args.duration + 90  # startup, corpus fetch and the clean stop fit in this margin
        next_print = t0 + args.print_every
        while time.monotonic() < deadline and any(p.proc.poll() is None for p in swarm.peers.values()):
            time.sleep(0.5)
            if time.monotonic() >= next_print:
                next_print += args.print_every
                cells = []
                for name in names:
                    inner = swarm.events(name, "inner")
                    if inner:
                        cells.append(f"{name}: outer {inner[-1]['outer_step']:3d} loss {inner[-1]['loss']:.3f}")
                print(f"[{time.monotonic() - t0:5.0f}s] " + "  ".join(cells), flush=True)
        codes = swarm.stop_all()
        summary = summarize(swarm, names)

    print("\npeer  outer  failed  round_s  rounds/min  tok/s   loss first -> last   eval_loss (outer step)")
    for name, s in summary.items():
        curve = s["eval_curve"]
        shown = [curve[i] for i in sorted({0, len(curve) // 2, len(curve) - 1})] if curve else []
        fmt = lambda v, f: (f % v) if v is not None else "-"  # noqa: E731
        print(f"{name:4s}  {s['outer_steps']:5d}  {s['rounds_failed']:6d}  {fmt(s['round_s'], '%7.2f')}  "
              f"{fmt(s['rounds_per_min'], '%10.1f')}  {fmt(s['tokens_per_s'], '%6.0f')}   "
              f"{fmt(s['first_loss'], '%.3f')} -> {fmt(s['last_loss'], '%.3f')}   "
              + " ".join(f"{v}({k})" for k, v in shown))
    bad = {n: c for n, c in codes.items() if c != 0}
    if bad:
        print(f"demo: peers exited with {bad}; see {workdir}/*.stderr", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
