#!/usr/bin/env python3
"""What the robust rule costs a round at real size: N peers of the 88.6M `small-gpu` preset on this CPU
(batch 1, H=3, one thread each, as scripts/scale.py's `real` size), once under the weighted mean and
once under CenteredClip with the reducer check (the default), each for --duration seconds of rounds.

    python scripts/defence_cost.py --members 3 4 --duration 240 --out runs/defence
    python scripts/defence_cost.py --size tiny --members 3 --duration 20       # the suite's size

Per (members, rule): the median and p90 round time of the rounds that held every peer, how many rounds
held fewer, the reducer check's seconds; then per member count the robust rule's median over the mean's
(target <= 1.15x). Every peer starts from the same init through a DHT node that trains nothing, and
waits for the others before its first step; rules run one after the other, never side by side (2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from scale import SIZES  # noqa: E402

from p2pdiloco.localswarm import LocalSwarm  # noqa: E402

RULES = {"mean": ["--aggregation", "mean", "--no-check-reducers"],
         "centered_clip": ["--aggregation", "centered_clip", "--check-reducers"]}
TARGET = 1.15


def run(size: str, members: int, rule: str, duration: float, workdir: Path) -> dict:
    preset, flags = SIZES[size]
    names = [chr(ord("a") + i) for i in range(members)]
    args = [*flags, *RULES[rule], "--target-group-size", str(members), "--wait-for-peers", str(members),
            "--run-id", f"defence-{members}-{rule}", "--max-time", str(duration),
            "--state-timeout", "5"]  # every peer starts from the same init: no state to look for
    with LocalSwarm(workdir, config=preset, extra_args=args) as swarm:
        swarm.start_bootstrap("boot")
        for name in names:
            swarm.start(name, join="boot")
        swarm.wait_for(lambda: all(swarm.peers[n].proc.poll() is not None for n in names),
                       timeout=duration + 600, what="every peer's --max-time")
        codes = swarm.stop_all()
        outer = [r for n in names for r in swarm.events(n, "outer")]
        checks = [r["check_s"] for n in names for r in swarm.events(n, "reducer_check") if r.get("check_s")]
        failed = [r["reason"] for n in names for r in swarm.events(n, "round_failed")]
    whole = sorted(r["round_s"] for r in outer if r["group_size"] >= members)
    return {"members": members, "rule": rule, "exit_codes": codes, "rounds_whole": len(whole),
            "rounds_partial": len(outer) - len(whole), "rounds_failed": len(failed), "failed": failed[:5],
            "round_s_median": statistics.median(whole) if whole else None,
            "round_s_p90": whole[int(0.9 * (len(whole) - 1))] if whole else None,
            "check_s_median": statistics.median(checks) if checks else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="real")
    parser.add_argument("--members", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--duration", type=float, default=240.0, help="seconds each swarm trains (--max-time)")
    parser.add_argument("--rules", nargs="+", choices=sorted(RULES), default=list(RULES))
    parser.add_argument("--out", default="", help="directory for the peers' logs and result.json")
    args = parser.parse_args(argv)
    if min(args.members) < 2:
        parser.error("--members: at least 2")
    out = Path(args.out or tempfile.mkdtemp(prefix="p2pdiloco-defence-"))
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for members in args.members:
        for rule in args.rules:
            t0 = time.monotonic()
            result = run(args.size, members, rule, args.duration, out / f"{members}-{rule}")
            result["wall_s"] = round(time.monotonic() - t0, 1)
            results.append(result)
            print(json.dumps(result), flush=True)
    ratios = {}
    for members in args.members:
        by_rule = {r["rule"]: r["round_s_median"] for r in results if r["members"] == members}
        if by_rule.get("mean") and by_rule.get("centered_clip"):
            ratios[members] = by_rule["centered_clip"] / by_rule["mean"]
            print(f"defence_cost: {members} members: centered_clip {by_rule['centered_clip']:.1f} s / mean "
                  f"{by_rule['mean']:.1f} s = {ratios[members]:.2f}x (target <= {TARGET}x: "
                  f"{'met' if ratios[members] <= TARGET else 'MISSED'})")
        else:
            print(f"defence_cost: {members} members: no whole round under one of the rules")
    (out / "result.json").write_text(json.dumps({"size": args.size, "runs": results, "ratios": ratios}, indent=1))
    print(f"defence_cost: result.json in {out}")
    return 0 if all(r["rounds_whole"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
