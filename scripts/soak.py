#!/usr/bin/env python3
"""Hours without a leak: the chaos runner's churn (kills, restarts, joins) with every process of
every peer sampled once a minute.

    python scripts/soak.py --duration 7200 --peers 4 --fault-every 300 --workdir runs/soak --plot docs/img/soak.png
    python scripts/soak.py --duration 60 --sample-every 5 --fault-every 20      # the suite's size

Every `--sample-every` seconds: PSS and open file descriptors of each live process (trainer,
averager, DHT, p2pd of each peer; scripts/procmem.py), and the sockets and files that p2pd and
hivemind leave in /tmp. At the end, per process that lived past the warm-up (`--warmup`, 10 min)
for at least `--min-span` seconds more: the slope of its PSS (least squares, MB per hour) and its
fd growth; /tmp entries before the run and after it; and the chaos runner's checks (the longest
stall, every peer's last eval loss). Target (issue 11): every slope <= 1 MB/h, no fd or /tmp growth,
no stall over 60 s. WORKDIR/soak.json holds every sample.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import chaos  # noqa: E402
from procmem import Every, peer_roles, sample  # noqa: E402

from p2pdiloco.localswarm import LocalSwarm  # noqa: E402

TARGET_SLOPE_MB_PER_H = 1.0


def tmp_entries() -> set[str]:
    """What p2pd and hivemind leave in /tmp: unix sockets and their files."""
    return {p.name for p in Path("/tmp").iterdir() if p.name.startswith(("hivemind", "p2pd", "p2p"))
            or p.suffix == ".sock" or p.is_socket()}


class Samples:
    """Every process of every live peer (PSS, fds) and the /tmp entries, one call at a time."""

    def __init__(self, swarm: LocalSwarm):
        self.swarm = swarm
        self.samples: list[dict] = []  # {"t", "peer", "role", "pid", "pss_mb", "fds"}
        self.tmp: list[tuple[float, int]] = []

    def take(self) -> None:
        now = time.time()
        for name, peer in list(self.swarm.peers.items()):
            if peer.proc.poll() is None:
                for role, values in sample(peer_roles(peer.pgid)).items():
                    self.samples.append({"t": now, "peer": name, "role": role, "pid": values["pid"],
                                         "pss_mb": values["pss_mb"], "uss_mb": values["uss_mb"],
                                         "fds": values["fds"]})
        self.tmp.append((now, len(tmp_entries())))


def slope_mb_per_h(points: list[tuple[float, float]]) -> float:
    n = len(points)
    mt, mv = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / var * 3600 if var else 0.0


def per_process(samples: list[dict], *, warmup: float, min_span: float) -> list[dict]:
    """Slope and fd growth of each process that lived `min_span` s past its own warm-up."""
    by_pid: dict[int, list[dict]] = {}
    for s in samples:
        by_pid.setdefault(s["pid"], []).append(s)
    out = []
    for pid, rows in by_pid.items():
        start = rows[0]["t"] + warmup
        late = [r for r in rows if r["t"] >= start]
        if len(late) < 3 or late[-1]["t"] - late[0]["t"] < min_span:
            continue
        out.append({"pid": pid, "peer": rows[0]["peer"], "role": rows[0]["role"],
                    "span_min": (late[-1]["t"] - late[0]["t"]) / 60, "pss_mb_first": late[0]["pss_mb"],
                    "pss_mb_last": late[-1]["pss_mb"],
                    "slope_mb_per_h": slope_mb_per_h([(r["t"], r["pss_mb"]) for r in late]),
                    # private pages only: PSS also moves when other processes that share its libraries
                    # start or die (their pages are split among more or fewer), which churn does all along
                    "uss_slope_mb_per_h": slope_mb_per_h([(r["t"], r.get("uss_mb", 0.0)) for r in late]),
                    "fds_first": late[0]["fds"], "fds_last": late[-1]["fds"],
                    "fds_max": max(r["fds"] for r in late)})
    return sorted(out, key=lambda r: (r["peer"], r["role"], r["pid"]))


def plot(samples: list[dict], path: Path) -> None:
    from p2pdiloco.plot import pyplot

    plt = pyplot()
    roles = ("trainer", "averager", "dht", "p2pd")
    fig, axes = plt.subplots(1, len(roles), figsize=(4 * len(roles), 3.2))
    t0 = min(s["t"] for s in samples)
    for ax, role in zip(axes, roles):
        by_pid: dict[int, list] = {}
        for s in samples:
            if s["role"] == role:
                by_pid.setdefault(s["pid"], []).append(((s["t"] - t0) / 60, s["pss_mb"]))
        for points in by_pid.values():
            ax.plot(*zip(*points), lw=1)
        ax.set_title(f"{role}: PSS (MB), one line per process", fontsize=9)
        ax.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--duration", type=float, default=7200.0)
    parser.add_argument("--fault-every", type=float, default=300.0, help="mean seconds between faults (±25%%)")
    parser.add_argument("--sample-every", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=600.0, help="seconds of each process's life not fitted")
    parser.add_argument("--min-span", type=float, default=1800.0, help="seconds fitted at least, per process")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", default="runs/soak")
    parser.add_argument("--data", default="", help="corpus for every peer (default: the preset's)")
    parser.add_argument("--plot", default="", help="PNG of every process's PSS over time")
    parser.add_argument("--slowdown", type=float, default=10.0,
                        help="peers sleep (slowdown-1) x their step time: 4 paced peers leave the cores mostly idle")
    args = parser.parse_args(argv)
    if args.peers < 2 or min(args.duration, args.fault_every, args.sample_every) <= 0:
        parser.error("--peers must be >= 2; --duration, --fault-every, --sample-every positive")
    signal.signal(signal.SIGTERM, chaos._terminate)  # SIGTERM unwinds through the finallys that stop the peers
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    flags = chaos.detect_peer_flags()
    common = ["--slowdown", str(args.slowdown), *(["--data", str(Path(args.data).resolve())] if args.data else [])]
    tmp_before = tmp_entries()
    record = chaos.RunRecord(workdir=workdir)
    with LocalSwarm(workdir, config=str(ROOT / "peers" / "tiny-cpu.toml")) as swarm, \
            Every((sampler := Samples(swarm)).take, args.sample_every, first_at_once=True):
        runner = chaos.Runner(swarm, record, rng=random.Random(args.seed), peers=args.peers,
                              duration=args.duration, fault_every=args.fault_every, print_every=300.0,
                              label="soak", chaos=True,
                              args_for=lambda name: [*chaos.base_peer_args(name, workdir, flags), *common])
        try:
            runner.start_initial()
            runner.loop()
        finally:
            record.t_end = record.t_end or time.time()
            record.stop_codes = swarm.stop_all(timeout=chaos.STOP_TIMEOUT)
    time.sleep(2.0)
    tmp_after = tmp_entries()
    stats = chaos.analyze(record)
    processes = per_process(sampler.samples, warmup=args.warmup, min_span=args.min_span)
    worst = max((p["slope_mb_per_h"] for p in processes), default=None)
    worst_uss = max((p["uss_slope_mb_per_h"] for p in processes), default=None)
    fd_growth = max((p["fds_last"] - p["fds_first"] for p in processes), default=None)
    result = {"args": vars(args), "faults": len(record.faults), "longest_stall_s": stats.get("longest_stall_s"),
              "processes": processes, "worst_slope_mb_per_h": worst, "worst_uss_slope_mb_per_h": worst_uss,
              "worst_fd_growth": fd_growth,
              "tmp_left_behind": sorted(tmp_after - tmp_before), "tmp_counts": sampler.tmp,
              "chaos": {k: v for k, v in stats.items() if not isinstance(v, (list, dict))},
              "samples": sampler.samples}
    (workdir / "soak.json").write_text(json.dumps(result, indent=1, default=str))
    if args.plot and sampler.samples:
        plot(sampler.samples, Path(args.plot))
    print(f"{'peer':5} {'role':9} {'pid':>8} {'minutes':>8} {'PSS first':>10} {'last':>8} {'MB/h':>8} "
          f"{'USS MB/h':>9} {'fds':>9}")
    for p in processes:
        print(f"{p['peer']:5} {p['role']:9} {p['pid']:>8} {p['span_min']:>8.0f} {p['pss_mb_first']:>10.1f} "
              f"{p['pss_mb_last']:>8.1f} {p['slope_mb_per_h']:>8.2f} {p['uss_slope_mb_per_h']:>9.2f} "
              f"{p['fds_first']:>4}->{p['fds_last']:<4}")
    print(f"faults {len(record.faults)}; longest stall {result['longest_stall_s']} s; "
          f"processes fitted {len(processes)}; worst slope {worst if worst is None else round(worst, 2)} MB/h "
          f"(USS {worst_uss if worst_uss is None else round(worst_uss, 2)}) "
          f"(target <= {TARGET_SLOPE_MB_PER_H}); worst fd growth {fd_growth}; "
          f"/tmp entries left behind: {len(result['tmp_left_behind'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
