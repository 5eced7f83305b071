#!/usr/bin/env python3
"""What a member killed in the middle of a round costs the others: 4 `tiny-cpu` peers on loopback; each
offset kills the newest peer that many seconds after its round began (SIGKILL of its process group), prints
what each survivor's next rounds did (seconds after the kill, why a round failed, which members it lost),
then starts a fresh peer in its place.

    python scripts/kill_in_round.py --offsets 0.3,0.5,0.7 --workdir runs/kill_in_round
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pdiloco.localswarm import LocalSwarm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WATCH_S = 20.0  # seconds of the survivors' rounds to report after each kill


def _terminate(signum, frame):  # SIGTERM: unwind through LocalSwarm's `finally`, which stops the peers
    raise KeyboardInterrupt


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offsets", default="0.3,0.5", help="seconds after the victim's round began, comma-separated")
    parser.add_argument("--workdir", default="runs/kill_in_round")
    parser.add_argument("--config", default=str(ROOT / "peers" / "tiny-cpu.toml"))
    args = parser.parse_args(argv)
    try:
        offsets = [float(x) for x in args.offsets.split(",")]
    except ValueError:
        parser.error(f"--offsets: not a list of numbers: {args.offsets!r}")
    if not 1 <= len(offsets) <= 22 or min(offsets) < 0:
        parser.error("--offsets: 1 to 22 offsets, none negative")
    signal.signal(signal.SIGTERM, _terminate)
    names = iter("abcdefghijklmnopqrstuvwxyz")
    with LocalSwarm(Path(args.workdir), config=args.config) as swarm:
        live = [next(names) for _ in range(4)]
        swarm.start(live[0])
        for name in live[1:]:
            swarm.start(name, join=live[0])
        swarm.wait_for(lambda: all(len(swarm.events(n, "outer")) >= 2 for n in live), timeout=150,
                       what="2 outer steps on every peer")
        for offset in offsets:
            victim = live.pop()
            entered = len(swarm.events(victim, "allreduce_started"))
            swarm.wait_for(lambda: len(swarm.events(victim, "allreduce_started")) > entered, timeout=60,
                           what=f"{victim}'s next round")
            began = swarm.events(victim, "allreduce_started")[-1]["time"]
            time.sleep(max(0.0, began + offset - time.time()))
            swarm.signal(victim, signal.SIGKILL)
            t_kill = time.time()
            time.sleep(WATCH_S)
            row = {"offset_s": offset, "victim": victim}
            for name in live:
                rounds = [r for r in swarm.events(name) if r.get("event") in ("outer", "round_failed")
                          and r["time"] > t_kill - 0.5][:3]
                row[name] = [{"event": r["event"], "after_kill_s": round(r["time"] - t_kill, 2),
                              "reason": r.get("reason", "")[:80], "lost": r.get("lost"),
                              "group_size": r.get("group_size"), "swarm_size": r.get("swarm_size")} for r in rounds]
            print(json.dumps(row), flush=True)
            fresh = next(names)
            swarm.start(fresh, join=live[0])
            live.append(fresh)
            swarm.wait_for(lambda: len(swarm.events(fresh, "outer")) >= 2, timeout=120, what=f"{fresh} averaging")
        swarm.stop_all()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("kill_in_round: interrupted; every peer stopped", file=sys.stderr)
        sys.exit(130)
