#!/usr/bin/env python3
"""Churn soak: a local swarm of real `p2pdiloco join` peers, killed, restarted and joined on a seeded schedule.

    python scripts/chaos.py --peers 5 --duration 600 --fault-every 20 --seed 1 --workdir runs/chaos
    python scripts/chaos.py --peers 3 --duration 50 --fault-every 15 --data corpus.txt -- --inner-steps 30
    python scripts/chaos.py ... --baseline        # then a fault-free swarm of the same size and duration

Peer p0 starts the swarm; p1..pN-1 join through a random live peer. Every ~fault_every seconds
(±25%) one fault, drawn from random.Random(seed):

    kill           SIGKILL of a live peer's whole process group (trainer, DHT, averager, p2pd); it stays dead
    kill_restart   the same, then 3-8 s later the same name restarts with the same flags through a live peer
    join           a killed peer comes back, or a peer with a new name joins
    freeze         with --freeze S only: SIGSTOP of a live peer's whole process group, SIGCONT S seconds later
                   (a machine suspended past a round; without --freeze a seed draws the same faults as before)

At least 2 peers stay up (no kill unless 3 or more are up, i.e. started and listening) and at most
peers + 2 run. Flags after `--` go to every peer. At the end: a markdown table (faults, rounds
applied and discarded, resyncs, longest stall, outer step, eval losses, anchor spread, goodput),
WORKDIR/chaos.json, and exit code 0 only if the outer step rose (>= 3 for a run of 60 s or more),
no stall exceeded 60 s and every peer's last eval loss is finite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pdiloco.localswarm import LocalSwarm  # noqa: E402
from p2pdiloco.metrics import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FAULT_KINDS = ("kill", "kill_restart", "join", "freeze")
RESTART_DELAY = (3.0, 8.0)  # seconds between the kill and the restart of a kill_restart
STOP_TIMEOUT = 30.0  # stop_all: SIGTERM, then SIGKILL of what is left after this many seconds
SAFETY_MARGIN = 120.0  # every peer gets --max-time so that nothing outlives a killed runner by long


# --------------------------------------------------------------------------------- peer flags

def detect_peer_flags() -> dict[str, bool]:
    """Which of the optional per-peer flags this version of `p2pdiloco join` knows (read from --help)."""
    try:
        out = subprocess.run([sys.executable, "-m", "p2pdiloco", "join", "--help"], capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL).stdout
    except (subprocess.TimeoutExpired, OSError) as e:
        print(f"chaos: note: `p2pdiloco join --help` failed ({e!r}); no --checkpoint-dir/--identity-path", flush=True)
        out = ""
    return {flag: flag in out for flag in ("--checkpoint-dir", "--identity-path")}


def base_peer_args(name: str, workdir: Path, flags: dict[str, bool]) -> list[str]:
    args = []
    if flags.get("--checkpoint-dir"):
        args += ["--checkpoint-dir", str(workdir / f"{name}.ckpt")]
    if flags.get("--identity-path"):
        args += ["--identity-path", str(workdir / f"{name}.key")]
    return args


# ---------------------------------------------------------------------------------- running

@dataclass
class RunRecord:
    """What the runner did, for the analysis: start times per name (incarnation boundaries), faults."""
    workdir: Path
    t_start: float = 0.0  # unix time when every initial peer had been started
    t_end: float = 0.0  # unix time when the schedule ended (before stop_all)
    starts: dict = field(default_factory=dict)  # name -> [unix time of each start]
    faults: list = field(default_factory=list)  # {"t", "kind", "name", ...}
    unexpected_exits: list = field(default_factory=list)  # {"t", "name", "code"}
    skipped_restarts: list = field(default_factory=list)  # names whose restart fell after the end
    alive_at_end: list = field(default_factory=list)
    stop_codes: dict = field(default_factory=dict)
    live_max_outer_step: int = 0
    via: dict = field(default_factory=dict)  # name -> the peer its latest start joined through
    stderr_offsets: dict = field(default_factory=dict)  # name -> size of NAME.stderr at its latest start


class MetricsTail:
    """New records of every peer's metrics.jsonl since the last poll (complete lines only)."""

    def __init__(self):
        self.offsets: dict[Path, int] = {}

    def poll(self, path: Path) -> list[dict]:
        if not path.exists():
            return []
        offset = self.offsets.get(path, 0)
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        self.offsets[path] = offset + end + 1
        records = []
        for line in chunk[:end].splitlines():
            try:
                records.append(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue  # a line torn by a SIGKILL
        return records


class Runner:
    def __init__(self, swarm: LocalSwarm, record: RunRecord, *, rng, peers: int, duration: float,
                 fault_every: float, args_for, print_every: float, label: str, chaos: bool, freeze_s: float = 0.0):
        self.swarm, self.record, self.rng = swarm, record, rng
        self.initial = peers
        self.max_peers = peers + 2
        self.duration = duration
        self.fault_every = fault_every
        self.args_for = args_for  # name -> the flags it starts with, the same at every restart
        self.print_every = print_every
        self.label = label
        self.chaos = chaos
        self.freeze_s = freeze_s
        self.frozen: dict[str, float] = {}  # name -> monotonic time of its SIGCONT
        self.alive: set[str] = set()
        self.dead: set[str] = set()  # killed (or exited by themselves), may come back through `join`
        self.pending: list[tuple[float, str]] = []  # (monotonic time, name) to start
        self.tail = MetricsTail()
        self.via: dict[str, Optional[str]] = {}  # name -> the peer its latest start joined through
        self.next_index = peers
        self.max_outer_step = 0
        self.last_outer_time: Optional[float] = None
        self.end = 0.0

    # -------------------------------------------------------------------- helpers

    def say(self, msg: str) -> None:
        elapsed = time.time() - self.record.t_start if self.record.t_start else 0.0
        print(f"{self.label}[{elapsed:5.0f}s] {msg}", flush=True)

    def running(self, name: str) -> bool:
        peer = self.swarm.peers.get(name)
        return peer is not None and peer.proc.poll() is None

    def ready(self) -> list[str]:
        """Live peers that have written their multiaddrs: addresses a newcomer can join through."""
        out = []
        for name in sorted(self.alive):
            peer = self.swarm.peers[name]
            try:
                if self.running(name) and peer.maddrs_file.exists() and peer.maddrs_file.read_text().strip():
                    out.append(name)
            except OSError:
                continue
        return out

    def start(self, name: str) -> bool:
        """Start (or restart) `name` through a random ready peer; False if nobody is ready yet."""
        via = self.ready()
        if not via and self.record.starts:
            return False  # only p0 starts a swarm; everybody else joins one
        join = self.rng.choice(via) if via else None
        remaining = max(0.0, self.end - time.monotonic()) if self.end else self.duration
        # --max-time only as a safety net: stop_all ends the peers long before it, even restarted ones
        args = [*self.args_for(name), "--max-time", f"{remaining + SAFETY_MARGIN:.0f}"]
        stderr_path = self.swarm.workdir / f"{name}.stderr"
        offset = stderr_path.stat().st_size if stderr_path.exists() else 0
        self.record.starts.setdefault(name, []).append(time.time())
        try:
            self.swarm.start(name, *args, join=join)
        except (RuntimeError, TimeoutError, KeyError) as e:  # the peer to join through died in between
            self.say(f"could not start {name} through {join}: {e}")
            self.record.starts[name].pop()
            if not self.record.starts[name]:
                del self.record.starts[name]
            return False
        self.via[name] = join
        self.record.stderr_offsets[name] = offset  # the file is appended to by every incarnation
        self.alive.add(name)
        self.dead.discard(name)
        return True

    def kill(self, name: str) -> None:
        self.swarm.signal(name, signal.SIGKILL, whole_group=True)
        try:
            self.swarm.peers[name].proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.forget(name)

    def forget(self, name: str) -> None:
        """Reap what is left of a dead peer's process group now, then drop it from the swarm's table:
        stop_all would otherwise reap that group id again at the end, when the number may belong to
        another process group (pid_max is often 32768 and every peer start takes several pids)."""
        LocalSwarm.reap(self.swarm.peers.pop(name))
        self.alive.discard(name)

    # ---------------------------------------------------------------------- phases

    def start_initial(self) -> None:
        names = [f"p{i}" for i in range(self.initial)]
        self.start(names[0])
        self.swarm.maddr(names[0], timeout=90)
        for name in names[1:]:
            self.start(name)  # p0 at least is ready
        self.record.t_start = time.time()
        self.end = time.monotonic() + self.duration

    def poll_metrics(self) -> None:
        for name in list(self.record.starts):
            for r in self.tail.poll(self.swarm.workdir / name / "metrics.jsonl"):
                if r.get("event") == "outer":
                    self.max_outer_step = max(self.max_outer_step, int(r.get("outer_step") or 0))
                    t = float(r.get("time") or 0.0)
                    self.last_outer_time = max(self.last_outer_time or t, t)

    def check_exits(self) -> None:
        for name in sorted(self.alive):
            if not self.running(name):
                code = self.swarm.peers[name].proc.returncode
                error = _last_error(self.swarm.peers[name].stderr_path, self.record.stderr_offsets.get(name, 0))
                via = self.via.get(name)
                via_up = via is not None and self.running(via)
                self.say(f"peer {name} exited by itself with code {code} (joined through {via}, "
                         f"{'still up' if via_up else 'gone'}): {error}")
                self.record.unexpected_exits.append({"t": round(time.time() - self.record.t_start, 1),
                                                     "name": name, "code": code, "via": via,
                                                     "via_still_up": via_up, "error": error})
                self.forget(name)
                self.dead.add(name)

    def thaw(self, now: float = math.inf) -> None:
        """SIGCONT to the frozen peers whose time is up (all of them by default: before the stop)."""
        for name, at in list(self.frozen.items()):
            if at <= now:
                del self.frozen[name]
                if name in self.swarm.peers:
                    self.swarm.signal(name, signal.SIGCONT, whole_group=True)
                    self.say(f"thawed {name}")

    def run_pending(self, now: float) -> None:
        for item in sorted(self.pending):
            at, name = item
            if at <= now and self.start(name):
                self.pending.remove(item)
                self.say(f"started {name} (alive {len(self.alive)})")

    def inject(self) -> None:
        alive = sorted(self.alive - set(self.frozen))  # a frozen peer is neither killed nor frozen again
        kinds = []
        # "alive" for the floor of 2 means up (multiaddrs written): a peer still starting cannot be
        # joined through, and killing the last working peers would leave the starters nothing to join
        if len(alive) > 2 and len(self.ready()) > 2:
            kinds += ["kill", "kill_restart"]
        if len(self.alive) + len(self.pending) < self.max_peers:
            kinds.append("join")
        if self.freeze_s > 0 and len(alive) > 2 and len(self.ready()) > 2:  # last: without it, the same draws
            kinds.append("freeze")
        if not kinds:
            return
        kind = self.rng.choice(kinds)
        t = round(time.time() - self.record.t_start, 1)
        if kind in ("kill", "kill_restart"):
            name = self.rng.choice(alive)
            self.kill(name)
            if kind == "kill_restart":
                delay = self.rng.uniform(*RESTART_DELAY)
                self.pending.append((time.monotonic() + delay, name))
                note = f"restart in {delay:.1f}s"
            else:
                self.dead.add(name)
                note = "stays dead"
        elif kind == "freeze":
            name = self.rng.choice(alive)
            self.swarm.signal(name, signal.SIGSTOP, whole_group=True)
            self.frozen[name] = time.monotonic() + self.freeze_s
            note = f"SIGCONT in {self.freeze_s:g}s"
        else:
            dead = sorted(self.dead)
            if dead and self.rng.random() < 0.5:
                name, note = self.rng.choice(dead), "comes back"
            else:
                name, note = f"p{self.next_index}", "new peer"
                self.next_index += 1
            self.dead.discard(name)
            self.pending.append((time.monotonic(), name))
        self.record.faults.append({"t": t, "kind": kind, "name": name,
                                   **({"for_s": self.freeze_s} if kind == "freeze" else {})})
        self.say(f"fault {kind} {name}: {note} (alive {len(self.alive)})")

    def loop(self) -> None:
        """Poll every second until the duration is over; inject faults on the seeded schedule."""
        next_fault = time.monotonic() + self.fault_every * self.rng.uniform(0.75, 1.25)
        next_print = time.monotonic() + self.print_every
        while True:
            now = time.monotonic()
            if now >= self.end:
                break
            time.sleep(min(1.0, max(0.0, self.end - now)))
            now = time.monotonic()
            self.poll_metrics()
            self.thaw(now)
            self.check_exits()
            if now < self.end:
                self.run_pending(now)
                if self.chaos and now >= next_fault:
                    self.inject()
                    next_fault = now + self.fault_every * self.rng.uniform(0.75, 1.25)
            if now >= next_print:
                next_print += self.print_every
                since = time.time() - (self.last_outer_time or self.record.t_start)
                self.say(f"alive {len(self.alive)} ({' '.join(sorted(self.alive))})  max outer_step "
                         f"{self.max_outer_step}  faults {len(self.record.faults)}  no outer event for {since:.0f}s")
        self.record.t_end = time.time()
        self.record.alive_at_end = sorted(n for n in self.alive if self.running(n))
        self.record.skipped_restarts = [name for _, name in self.pending]
        self.record.via = dict(self.via)
        self.record.live_max_outer_step = self.max_outer_step
        if self.pending:
            self.say(f"end of the run: {len(self.pending)} pending start(s) dropped: {self.record.skipped_restarts}")


def run_swarm(workdir: Path, *, peers: int, duration: float, fault_every: float, seed: int, config: str,
              common: list[str], extra: list[str], flags: dict, print_every: float, chaos: bool,
              label: str, freeze_s: float = 0.0) -> RunRecord:
    record = RunRecord(workdir=workdir)
    with LocalSwarm(workdir, config=config, extra_args=extra) as swarm:
        runner = Runner(swarm, record, rng=random.Random(seed), peers=peers, duration=duration,
                        fault_every=fault_every, print_every=print_every, label=label, chaos=chaos, freeze_s=freeze_s,
                        args_for=lambda name: [*base_peer_args(name, workdir, flags), *common])
        try:
            runner.start_initial()
            runner.say(f"{peers} peers started; p0 at {swarm.maddr('p0')}")
            runner.loop()
        finally:
            runner.thaw()  # a stopped process cannot honour the SIGTERM
            if not record.t_end:
                record.t_end = time.time()
            record.stop_codes = swarm.stop_all(timeout=STOP_TIMEOUT)
    return record


# --------------------------------------------------------------------------------- analysis

def _reason_key(reason: str) -> str:
    """Failure reasons without the numbers and peer ids that make every one unique."""
    reason = re.sub(r"(12D3Koo|Qm)[1-9A-HJ-NP-Za-km-z]+", "<peer>", reason or "?")
    reason = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", reason)
    return reason[:120]


def _last_error(path: Path, offset: int = 0) -> str:
    """The last `p2pdiloco: error` line of a peer's stderr since `offset` (else its last line)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(offset, f.seek(0, os.SEEK_END) - 8000))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    errors = [ln for ln in lines if ln.startswith("p2pdiloco: error")]
    return (errors or lines or [""])[-1][:300]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _incarnations(records: list[dict], starts: list[float]) -> list[list[dict]]:
    """Split one name's records by the runner's start times (the file is appended to by each process)."""
    bounds = sorted(starts)[1:]
    parts: list[list[dict]] = [[] for _ in range(len(bounds) + 1)]
    for r in records:
        t = float(r.get("time") or 0.0)
        parts[sum(t >= b for b in bounds)].append(r)
    return parts


def _tokens_computed(inc: list[dict]) -> int:
    """The last `tokens` of `inner` events (a decrease also marks a new process); the partial interval
    after the last record of a killed process is not counted."""
    total, last = 0, None
    for r in inc:
        if r.get("event") != "inner" or r.get("tokens") is None:
            continue
        tokens = int(r["tokens"])
        if last is not None and tokens < last:
            total += last
        last = tokens
    return total + (last or 0)


TAIL_S = 60.0  # the last seconds of a run whose evaluations give tail_eval_loss
HARD_CLIP = 0.5  # a pseudo-gradient clipped below this factor counts as clipped hard


def tail_eval_loss(workdir: Path, names: list[str], t_end: float, window: float = TAIL_S) -> Optional[float]:
    """The median over `names` of each one's median eval loss in the run's last `window` seconds: the final
    eval is one anchor, which one partial group's outer step can move by tenths of a nat."""
    per_peer = []
    for name in names:
        path = workdir / name / "metrics.jsonl"
        records = read_metrics(path) if path.exists() else []
        evals = [r["eval_loss"] for r in records if r.get("event") == "eval" and _finite(r.get("eval_loss"))
                 and float(r.get("time") or 0) >= t_end - window]
        if evals:
            per_peer.append(statistics.median(evals))
    return statistics.median(per_peer) if per_peer else None


def robust_rule_stats(outer: list[dict], bans: int) -> dict:
    """What the robust rule did: bans, pseudo-gradients clipped hard (< HARD_CLIP) by a member's reducer,
    and the share of the senders' weight clipping removed per round (mean, p90)."""
    removed = sorted(float(r["removed"]) for r in outer if _finite(r.get("removed")))
    hard = sum(1 for r in outer for f in (r.get("clipped") or {}).values() if _finite(f) and f < HARD_CLIP)
    return {"bans": bans, "hard_clips": hard,
            "removed_mean": statistics.mean(removed) if removed else None,
            "removed_p90": removed[int(0.9 * (len(removed) - 1))] if removed else None}


def end_of_run(outer: list[dict], evals: dict[int, float], final: Optional[float],
               kept: Optional[float] = None) -> dict:
    """The final eval (of the anchor, and of the model the peers keep: their anchors' average) against the
    eval of the last anchor a whole group produced (a group that held every live peer its members counted)."""
    whole = [int(r["outer_step"]) for r in outer if r.get("swarm_size") and r["group_size"] >= r["swarm_size"]
             and int(r["outer_step"]) in evals]
    step = max(whole) if whole else None
    loss = evals.get(step) if step is not None else None

    def over(value):
        return value / loss if _finite(value) and _finite(loss) and loss else None
    return {"last_whole_outer_step": step, "last_whole_eval_loss": loss, "final_vs_last_whole": over(final),
            "kept_vs_last_whole": over(kept)}


def later_measures(workdir: Path, alive: list[str], t_end: float, final: Optional[float],
                   kept: Optional[float] = None) -> dict:
    """The measures added after a run was recorded (tail_eval_loss, end_of_run, robust_rule_stats), from its
    metrics files: `--reanalyze` adds them to an earlier run's chaos.json."""
    outer, evals, bans = [], {}, 0
    for path in sorted(workdir.glob("*/metrics.jsonl")):
        for r in read_metrics(path):
            if r.get("event") == "outer":
                outer.append(r)
            elif r.get("event") == "banned":
                bans += 1
            elif r.get("event") == "eval" and _finite(r.get("eval_loss")):
                evals.setdefault(int(r.get("outer_step") or 0), float(r["eval_loss"]))
    return {"tail_eval_loss": tail_eval_loss(workdir, alive, t_end), **end_of_run(outer, evals, final, kept),
            **robust_rule_stats(outer, bans)}


def analyze(record: RunRecord) -> dict:
    workdir = record.workdir
    names = sorted(record.starts, key=lambda n: (len(n), n))
    outer_all, failed_all, resyncs, joins = [], [], 0, 0
    tokens_applied = tokens_computed = 0
    last_eval: dict[str, Optional[float]] = {}
    kept_eval: dict[str, Optional[float]] = {}
    incarnations = {}
    lives: dict[str, list[list[dict]]] = {}  # name -> its incarnations' round entries, for rounds_to_whole
    for name in names:
        path = workdir / name / "metrics.jsonl"
        records = read_metrics(path) if path.exists() else []
        records.sort(key=lambda r: r.get("time") or 0.0)
        incarnations[name] = len(record.starts[name])
        incs = _incarnations(records, record.starts[name])
        lives[name] = [[r for r in inc if r.get("event") in ("outer", "round_failed") and _finite(r.get("entered"))
                        and _finite(r.get("time"))] for inc in incs]
        for inc in incs:
            applied = sum(int(r.get("tokens") or 0) for r in inc if r.get("event") == "outer")
            tokens_applied += applied
            tokens_computed += max(_tokens_computed(inc), applied)
        for r in records:
            ev = r.get("event")
            if ev == "outer":
                outer_all.append(r)
            elif ev == "round_failed":
                failed_all.append(r)
            elif ev == "resync":
                resyncs += 1
            elif ev == "join":
                joins += 1
            # the anchor's evaluations (in the background) and the final one; null means not finite
            if ev in ("eval", "final") and "eval_loss" in r:
                last_eval[name] = r["eval_loss"]
            if ev == "final" and "kept_eval_loss" in r:  # the model the peer keeps: its anchors' average
                kept_eval[name] = r["kept_eval_loss"]

    outer_all.sort(key=lambda r: r.get("time") or 0.0)
    times = [float(r["time"]) for r in outer_all if float(r.get("time") or 0.0) <= record.t_end]
    if times:
        gaps = [b - a for a, b in zip(times, times[1:])] + [max(0.0, record.t_end - times[-1])]
        longest_stall = max(gaps)
        first_outer_s = times[0] - record.t_start
    else:
        longest_stall = record.t_end - record.t_start
        first_outer_s = None
    tail = outer_all[-max(1, math.ceil(0.2 * len(outer_all))):] if outer_all else []
    spreads = [r["anchor_spread"] for r in tail if _finite(r.get("anchor_spread"))]
    max_outer = max([int(r.get("outer_step") or 0) for r in outer_all] + [record.live_max_outer_step, 0])
    live_evals = [last_eval[n] for n in record.alive_at_end if _finite(last_eval.get(n))]
    live_kept = [kept_eval[n] for n in record.alive_at_end if _finite(kept_eval.get(n))]
    reasons = Counter(_reason_key(r.get("reason", "")) for r in failed_all)
    target = _target_group_size(workdir, names)
    to_whole = rounds_to_whole(lives, _changes(record, lives), target) if target else []
    faults = Counter(f["kind"] for f in record.faults)
    return {
        "t_start_unix": record.t_start,
        "duration_s": round(record.t_end - record.t_start, 1),
        "faults": {**{k: faults.get(k, 0) for k in FAULT_KINDS}, "total": len(record.faults)},
        "fault_log": record.faults,
        "restarts_dropped_at_end": record.skipped_restarts,
        "unexpected_exits": record.unexpected_exits,
        "stop_codes": record.stop_codes,
        "unclean_stops": {n: {"code": record.stop_codes.get(n), "via": record.via.get(n),
                              "error": _last_error(workdir / f"{n}.stderr", record.stderr_offsets.get(n, 0))}
                          for n in record.alive_at_end if record.stop_codes.get(n) != 0},
        "incarnations": incarnations,
        "peers_alive_at_end": record.alive_at_end,
        "rounds_applied": len(outer_all),
        "rounds_failed": len(failed_all),
        "top_failure_reasons": reasons.most_common(3),
        "resyncs": resyncs,
        "state_joins": joins,
        "first_outer_s": round(first_outer_s, 1) if first_outer_s is not None else None,
        "longest_stall_s": round(longest_stall, 1),
        "max_outer_step": max_outer,
        "last_eval_loss": last_eval,
        "eval_loss_finite": bool(last_eval) and all(_finite(v) for v in last_eval.values()),
        "final_eval_loss": statistics.median(live_evals) if live_evals else None,
        "kept_eval_loss": statistics.median(live_kept) if live_kept else None,
        **later_measures(workdir, record.alive_at_end, record.t_end,
                         statistics.median(live_evals) if live_evals else None,
                         statistics.median(live_kept) if live_kept else None),
        "anchor_spread": max(spreads) if spreads else None,
        # after each kill, join and restart: rounds until a group holds every live peer (median surviving peer)
        "rounds_to_whole": to_whole,
        "changes_whole_within_2": sum(k is not None and k <= 2 for k in to_whole),
        "tokens_applied": tokens_applied,
        "tokens_computed": tokens_computed,
        "goodput": tokens_applied / tokens_computed if tokens_computed else None,
    }


def rounds_to_whole(lives: dict[str, list[list[dict]]], changes: list[float], target: int) -> list[Optional[float]]:
    """After each change of the swarm (a time of `changes`: a kill, or a joiner's or restarted peer's first
    entry), how many rounds a peer that stays up enters until its first applied round whose group held every
    live peer (up to `target`): the median over those peers; None when none got there. `lives`: name -> its
    incarnations' entries (outer and round_failed events with `entered`), in time order. A peer is live from
    an incarnation's first entry to its last event."""
    spans = [(name, inc[0]["entered"], inc[-1]["time"]) for name, incs in lives.items() for inc in incs if inc]

    def live(t: float) -> int:
        return sum(start <= t <= end for _, start, end in spans)

    out = []
    for change in sorted(changes):
        counts = []
        for name, start, end in spans:
            if not (start < change < end):  # up before the change and after it
                continue
            after = [r for inc in lives[name] for r in inc if r["time"] > change and start <= r["entered"] <= end]
            whole = [i for i, r in enumerate(after, start=1)
                     if r["event"] == "outer" and r["group_size"] >= min(target, live(r["entered"]))]
            counts.append(whole[0] if whole else math.inf)
        median = statistics.median(counts) if counts else None
        out.append(None if median is None or math.isinf(median) else median)
    return out


def _target_group_size(workdir: Path, names: list[str]) -> Optional[int]:
    """The peers' target_group_size, from the config a peer wrote into its log directory."""
    for name in names:
        try:
            return int(json.loads((workdir / name / "config.json").read_text())["target_group_size"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _changes(record: RunRecord, lives: dict[str, list[list[dict]]]) -> list[float]:
    """The times the swarm changed: each kill, each frozen peer's SIGCONT, and the first entry of each
    incarnation started by a fault."""
    out = []
    for fault in record.faults:
        at = record.t_start + fault["t"]
        if fault["kind"] in ("kill", "kill_restart"):
            out.append(at)
        if fault["kind"] == "freeze" and at + fault["for_s"] < record.t_end:
            out.append(at + fault["for_s"])
        if fault["kind"] in ("join", "kill_restart"):  # the incarnation started after the fault
            starts = sorted(record.starts.get(fault["name"], []))
            later = [inc for start, inc in zip(starts, lives.get(fault["name"], [])) if start >= at and inc]
            if later:
                out.append(later[0][0]["entered"])
    return out


def checks(stats: dict, *, duration: float, min_outer: int, max_stall: float) -> dict[str, tuple[bool, str]]:
    out = {}
    if duration >= 60:
        out["outer_step_rising"] = (stats["max_outer_step"] >= min_outer,
                                    f"final max outer_step {stats['max_outer_step']} (need >= {min_outer})")
    out["stall"] = (stats["longest_stall_s"] <= max_stall,
                    f"longest stall {stats['longest_stall_s']} s (limit {max_stall:g} s)")
    bad = {n: v for n, v in stats["last_eval_loss"].items() if not _finite(v)}
    out["eval_loss_finite"] = (stats["eval_loss_finite"],
                               f"non-finite last eval_loss: {bad}" if bad else
                               ("no peer recorded an eval_loss" if not stats["last_eval_loss"] else "all finite"))
    return out


def _fmt(v, spec: str) -> str:
    return format(v, spec) if _finite(v) else "-"


def table(stats: dict, baseline: Optional[dict]) -> str:
    f = stats["faults"]
    reasons = "; ".join(f"`{r}` ×{n}" for r, n in stats["top_failure_reasons"]) or "-"
    rows = [
        ("faults injected", f"{f['total']} (kill {f['kill']}, kill_restart {f['kill_restart']}, join {f['join']}, "
                            f"freeze {f.get('freeze', 0)})"),
        ("peers exited by themselves", str(len(stats["unexpected_exits"]))),
        ("peers not stopping cleanly at the end", str(len(stats["unclean_stops"]))),
        ("rounds applied (outer events, all peers)", str(stats["rounds_applied"])),
        ("rounds failed / discarded", str(stats["rounds_failed"])),
        ("top failure reasons", reasons),
        ("resyncs", str(stats["resyncs"])),
        ("first outer event after start (s)", _fmt(stats["first_outer_s"], ".1f")),
        ("longest stall (s)", _fmt(stats["longest_stall_s"], ".1f")),
        ("final max outer_step", str(stats["max_outer_step"])),
        ("every peer's last eval_loss finite", "yes" if stats["eval_loss_finite"] else "NO"),
        ("final eval loss (median, live peers)", _fmt(stats["final_eval_loss"], ".4f")),
        ("anchor spread (max, last 20% of rounds)", _fmt(stats["anchor_spread"], ".2e")),
        ("goodput (tokens applied / computed)",
         f"{_fmt(stats['goodput'], '.3f')} ({stats['tokens_applied']} / {stats['tokens_computed']})"),
        (f"eval loss over the last {TAIL_S:.0f} s (median of the live peers' medians)",
         _fmt(stats["tail_eval_loss"], ".4f")),
        ("final eval / the last whole group's anchor (outer step)",
         f"{_fmt(stats['final_vs_last_whole'], '.3f')} ({stats['last_whole_outer_step']})"),
        ("the kept model (anchors' average): final eval (median, live peers); over the last whole group's anchor",
         f"{_fmt(stats.get('kept_eval_loss'), '.4f')}; {_fmt(stats.get('kept_vs_last_whole'), '.3f')}"),
        ("kills, joins, restarts and thaws followed by a whole group within 2 rounds (rounds each took)",
         f"{stats.get('changes_whole_within_2', '-')} of {len(stats.get('rounds_to_whole', []))} "
         f"({', '.join('-' if k is None else f'{k:g}' for k in stats.get('rounds_to_whole', []))})"),
        ("bans; pseudo-gradients clipped hard (< 0.5)", f"{stats['bans']}; {stats['hard_clips']}"),
        ("weight the robust rule removed per round (mean / p90)",
         f"{_fmt(stats['removed_mean'], '.3f')} / {_fmt(stats['removed_p90'], '.3f')}"),
    ]
    if baseline is not None:
        ratio = stats.get("eval_loss_ratio")
        rows += [("baseline final eval loss (no faults)", _fmt(baseline["final_eval_loss"], ".4f")),
                 ("baseline max outer_step", str(baseline["max_outer_step"])),
                 ("eval loss ratio chaos / baseline", _fmt(ratio, ".3f")),
                 (f"last-{TAIL_S:.0f}-s eval ratio chaos / baseline", _fmt(stats.get("tail_eval_ratio"), ".3f")),
                 ("the kept model's final eval ratio chaos / baseline", _fmt(stats.get("kept_eval_ratio"), ".3f")),
                 ("baseline bans; hard clips; weight removed per round (mean / p90)",
                  f"{baseline['bans']}; {baseline['hard_clips']}; {_fmt(baseline['removed_mean'], '.3f')} / "
                  f"{_fmt(baseline['removed_p90'], '.3f')}")]
    lines = ["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def _compare(stats: dict, baseline: dict) -> None:
    """The chaos run's losses over the fault-free run's, into stats."""
    def ratio(ours, theirs):
        return ours / theirs if _finite(ours) and _finite(theirs) and theirs else None
    stats["baseline_final_eval_loss"] = baseline["final_eval_loss"]
    stats["eval_loss_ratio"] = ratio(stats["final_eval_loss"], baseline["final_eval_loss"])
    stats["tail_eval_ratio"] = ratio(stats["tail_eval_loss"], baseline["tail_eval_loss"])
    stats["kept_eval_ratio"] = ratio(stats.get("kept_eval_loss"), baseline.get("kept_eval_loss"))


def reanalyze(workdir: Path) -> int:
    """Add this version's later_measures to a finished run's chaos.json (and its baseline's), print the table."""
    try:
        out = json.loads((workdir / "chaos.json").read_text())
    except (OSError, ValueError) as e:
        print(f"chaos: error: no readable chaos.json in {workdir} ({e})", file=sys.stderr)
        return 2
    for stats, path in ((out, workdir), (out.get("baseline"), workdir / "baseline")):
        if stats is None:
            continue
        try:
            alive, t_end = stats["peers_alive_at_end"], stats["t_start_unix"] + stats["duration_s"]
        except (KeyError, TypeError) as e:
            print(f"chaos: error: {path / 'chaos.json'} lacks a run's fields ({e!r})", file=sys.stderr)
            return 2
        stats.update(later_measures(path, alive, t_end, stats.get("final_eval_loss"), stats.get("kept_eval_loss")))
    if out.get("baseline") is not None:
        _compare(out, out["baseline"])
    (workdir / "chaos.json").write_text(json.dumps(out, indent=2) + "\n")
    print(table(out, out.get("baseline")))
    return 0


# ------------------------------------------------------------------------------------- main

def _terminate(signum, frame):  # SIGTERM: unwind through the `finally`s that stop the peers
    raise KeyboardInterrupt


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Flags after `--` are passed to every peer.")
    parser.add_argument("--peers", type=int, default=5, help="initial swarm size (>= 2)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of churn after the peers started")
    parser.add_argument("--fault-every", type=float, default=20.0, help="mean seconds between faults (±25%%)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", default="runs/chaos")
    parser.add_argument("--config", default=str(ROOT / "peers" / "tiny-cpu.toml"))
    parser.add_argument("--data", default="", help="corpus for every peer (default: the preset's)")
    parser.add_argument("--baseline", action="store_true", help="then a fault-free swarm in WORKDIR/baseline")
    parser.add_argument("--max-stall", type=float, default=60.0, help="longest stall that passes (s)")
    parser.add_argument("--min-outer-steps", type=int, default=3, help="outer step to reach in a run >= 60 s")
    parser.add_argument("--freeze", type=float, default=0.0, metavar="S",
                        help="also draw freezes: SIGSTOP of a live peer for S seconds (0: no freezes, the default)")
    parser.add_argument("--print-every", type=float, default=15.0)
    parser.add_argument("--reanalyze", action="store_true",
                        help="run nothing: add this version's measures to WORKDIR/chaos.json and print its table")
    args = parser.parse_args(argv)
    if args.peers < 2:
        parser.error("--peers must be >= 2")
    if args.duration <= 0 or args.fault_every <= 0:
        parser.error("--duration and --fault-every must be positive")
    if not 0 <= args.freeze <= 60:  # also false for nan
        parser.error("--freeze must be between 0 and 60 seconds")

    if args.reanalyze:
        return reanalyze(Path(args.workdir).resolve())
    signal.signal(signal.SIGTERM, _terminate)
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    flags = detect_peer_flags()
    for flag, present in flags.items():
        if not present:
            print(f"chaos: note: `p2pdiloco join` has no {flag} yet; peers run without it", flush=True)
    common = ["--data", str(Path(args.data).resolve())] if args.data else []
    print(f"chaos: {args.peers} peers, {args.duration:.0f} s, a fault every ~{args.fault_every:g} s, "
          f"seed {args.seed}, logs in {workdir}", flush=True)
    run_kw = dict(peers=args.peers, duration=args.duration, fault_every=args.fault_every, seed=args.seed,
                  config=args.config, common=common, extra=extra, flags=flags, print_every=args.print_every)

    try:
        record = run_swarm(workdir, chaos=True, label="chaos", freeze_s=args.freeze, **run_kw)
        stats = analyze(record)
        baseline = None
        if args.baseline:
            print("chaos: baseline run without faults ...", flush=True)
            base_record = run_swarm(workdir / "baseline", chaos=False, label="baseline", **run_kw)
            baseline = analyze(base_record)
    except KeyboardInterrupt:  # the peers were stopped on the way out
        print("chaos: interrupted; every peer stopped", file=sys.stderr, flush=True)
        return 130
    except (RuntimeError, TimeoutError) as e:  # the first peer did not come up
        print(f"chaos: error: {e}", file=sys.stderr, flush=True)
        return 1
    if baseline is not None:
        _compare(stats, baseline)
    result = checks(stats, duration=args.duration, min_outer=args.min_outer_steps, max_stall=args.max_stall)
    ok = all(passed for passed, _ in result.values())
    out = {"args": {**vars(args), "extra": extra, "peer_flags": flags}, **stats,
           "checks": {k: {"ok": passed, "detail": detail} for k, (passed, detail) in result.items()},
           "ok": ok, "baseline": baseline}
    (workdir / "chaos.json").write_text(json.dumps(out, indent=2) + "\n")

    print()
    print(table(stats, baseline))
    print()
    for k, (passed, detail) in result.items():
        print(f"chaos: {'ok  ' if passed else 'FAIL'} {k}: {detail}")
    for e in stats["unexpected_exits"]:
        print(f"chaos: note: {e['name']} exited by itself at {e['t']} s with code {e['code']} (joined through "
              f"{e['via']}, {'still up' if e['via_still_up'] else 'gone'} then): {e['error']}")
    for name, e in stats["unclean_stops"].items():
        print(f"chaos: note: {name} did not stop cleanly (code {e['code']}, joined through {e['via']}): {e['error']}")
    print(f"chaos: {'PASS' if ok else 'FAIL'}; numbers in {workdir / 'chaos.json'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
