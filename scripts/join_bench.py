#!/usr/bin/env python3
"""A joiner and a frozen peer keep up with the swarm: 2 founders, then a joiner once they have
averaged; optionally a founder frozen (SIGSTOP) past a round, then woken.

    python scripts/join_bench.py --size real --duration 480            # 85M small-gpu peers on this CPU
    python scripts/join_bench.py --size real --duration 480 --freeze   # ... and b frozen for 2 rounds
                                                                       # (the run then lasts until a has applied
                                                                       # 3 rounds after b's first once woken)
    python scripts/join_bench.py --size tiny --duration 40             # the tiny setting the suite runs

Prints, for the joiner (and the frozen peer after it wakes): the share of the founders' rounds
in which it applied an outer step after its state download, and how many full-state downloads it
made (its join, plus resyncs). The target (issue 9): >= 80% of the rounds, 1 download per join.
Real `p2pdiloco join` processes on loopback; every process is reaped at the end.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2pdiloco.localswarm import LocalSwarm  # noqa: E402

SIZES = {
    # the 85M preset on this machine's CPU as a new user would try it: a round every ~20 s
    "real": (str(ROOT / "peers" / "small-gpu.toml"),
             ["--device", "cpu", "--batch-size", "1", "--inner-steps", "3", "--threads", "1", "--eval-batches", "1",
              "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]),
    "tiny": (str(ROOT / "peers" / "tiny-cpu.toml"), ["--inner-steps", "30", "--state-timeout", "5"]),
}


AFTER_WAKING = 3  # rounds of founder a after the frozen peer's first round once woken, before the run ends


def keeping_up(swarm: LocalSwarm, name: str, since: float, reference: str) -> dict:
    """Rounds `name` applied after `since`, against the distinct outer steps `reference` applied then."""
    mine = [r for r in swarm.events(name, "outer") if r["time"] > since]
    theirs = {r["outer_step"] for r in swarm.events(reference, "outer") if r["time"] > since}
    downloads = [r for r in swarm.events(name) if r["event"] in ("join", "resync")]
    return {"rounds_applied": len(mine), "reference_rounds": len(theirs),
            "share": len(mine) / len(theirs) if theirs else None,
            "downloads": len(downloads), "download_s": [r.get("download_s") for r in downloads],
            "merged_rounds": sum(bool(r.get("merged")) for r in mine)}


def run(size: str, duration: float, freeze: bool, workdir: Path, data: str = "") -> dict:
    preset, flags = SIZES[size]
    if data:
        flags = [*flags, "--data", data]
    round_bound = 120.0 if size == "real" else 30.0  # founders' first round, the joiner's first round
    with LocalSwarm(workdir, config=preset, extra_args=flags) as swarm:
        swarm.start("a")
        swarm.start("b", join="a")
        swarm.wait_for(lambda: all(swarm.events(n, "outer") for n in "ab"), timeout=4 * round_bound,
                       what="the founders' first round")
        t_start = time.time()
        swarm.start("c", join="a")
        swarm.wait_for(lambda: swarm.events("c", "join"), timeout=4 * round_bound, what="the joiner's download")
        t_joined = swarm.events("c", "join")[0]["time"]
        frozen = None
        if freeze:
            # b freezes past two of a's rounds (and past allreduce_timeout), then wakes
            swarm.wait_for(lambda: time.time() > t_joined + duration / 3, timeout=duration, what="mid-run")
            swarm.signal("b", signal.SIGSTOP)
            a_before = len(swarm.events("a", "outer"))
            try:
                swarm.wait_for(lambda: len(swarm.events("a", "outer")) >= a_before + 2, timeout=4 * round_bound,
                               what="two rounds of a while b is frozen")
            finally:
                swarm.signal("b", signal.SIGCONT)
            frozen = time.time()
            # b woke inside the round it froze in, which ends only at its own timeout (allreduce_timeout);
            # the run goes on until a has applied AFTER_WAKING rounds after that, whatever is left of `duration`
            # (a run cut 7 s after waking once counted 1 round of a and 0 of b's)
            swarm.wait_for(lambda: any(r["time"] > frozen for r in swarm.events("b")
                                       if r["event"] in ("outer", "round_failed")),
                           timeout=4 * round_bound, what="b's first round after waking")
            settled = time.time()
            swarm.wait_for(lambda: sum(r["time"] > settled for r in swarm.events("a", "outer")) >= AFTER_WAKING,
                           timeout=4 * round_bound, what=f"{AFTER_WAKING} rounds of a after b's first")
        swarm.wait_for(lambda: time.time() > t_start + duration, timeout=duration + 60, what="the run's end")
        result = {"size": size, "duration_s": duration, "joiner": keeping_up(swarm, "c", t_joined, "a")}
        if frozen is not None:
            result["frozen"] = keeping_up(swarm, "b", frozen, "a")
            result["frozen"]["downloads_after_waking"] = sum(
                r["event"] == "resync" and r["time"] > frozen for r in swarm.events("b"))
        rounds = [r["round_s"] for n in "abc" for r in swarm.events(n, "outer")]
        result["round_s_median"] = statistics.median(rounds) if rounds else None
        result["exit_codes"] = swarm.stop_all(timeout=30.0)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds after the joiner starts")
    parser.add_argument("--freeze", action="store_true", help="also freeze founder b past two rounds")
    parser.add_argument("--data", default="", help="corpus file (default: the bundled corpus)")
    parser.add_argument("--out", default="", help="directory for the peers' logs and result.json")
    args = parser.parse_args(argv)
    if args.duration <= 0:
        parser.error("--duration must be positive")
    out = Path(args.out or tempfile.mkdtemp(prefix="p2pdiloco-join-"))
    out.mkdir(parents=True, exist_ok=True)
    result = run(args.size, args.duration, args.freeze, out / "peers", args.data)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    for who in ("joiner", "frozen"):
        r = result.get(who)
        if r:
            share = "-" if r["share"] is None else f"{r['share']:.0%}"
            print(f"{who}: applied {r['rounds_applied']} of the founders' {r['reference_rounds']} rounds ({share}), "
                  f"{r['downloads']} full-state download(s), {r['merged_rounds']} merge round(s)")
    print(f"median round {result['round_s_median']:.1f} s; result.json in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
