#!/usr/bin/env python3
"""Benchmarks side by side: p2pdiloco against data-parallel and synchronous DiLoCo, measured here.

    python scripts/bench.py quality     # final eval loss: DDP, sync DiLoCo, decoupled H=50/100, codecs,
                                        #   and the negative control (Nesterov per contribution)
    python scripts/bench.py ablation    # the decoupled swarm's mechanisms on and off, at H and 2H, next to
                                        #   sync DiLoCo (--variants picks some; --size long for the long budget)
    python scripts/bench.py sweep       # outer_lr x outer_momentum for sync DiLoCo and the decoupled swarm, at H
    python scripts/bench.py traffic     # bytes on the wire per peer per inner step (network namespaces)
    python scripts/bench.py stragglers  # one peer 4x slower: swarm tokens/s, time to a target loss
    python scripts/bench.py slowlinks   # 50 Mbit/s links (tc tbf): wall time and compute utilization
    python scripts/bench.py overhead    # inner step inside `p2pdiloco join` vs a bare torch loop
    python scripts/bench.py hetero      # peers at speeds 1, 1, 0.5, 0.25: time to sync DiLoCo's loss
    python scripts/bench.py hivemind    # hivemind.Optimizer (local updates) vs the swarm, equal tokens and time,
                                        #   fault-free and one peer SIGKILLed
    python scripts/bench.py byzantine   # one attacking volunteer (sign flip, ALIE, IPM, noise, a lying reducer)
                                        #   against the weighted mean and centered clipping
    python scripts/bench.py byzantine_collude  # two attackers that send the same thing, centered clipping
    python scripts/bench.py all --repeat 2 --out runs/bench

Every comparison runs the baselines and p2pdiloco on the same model, data, seeds and token budget
(real `p2pdiloco join` processes, real torch.distributed/gloo DDP) and writes, into --out,
`results.json`, `results.md` (tables, each target marked met or MISSED) and PNG plots.
`--quick` is a tiny size (<= ~1 min per comparison, runs in parallel) that the tests run; its
numbers mean nothing. traffic and slowlinks need root for `ip netns`; without it they say why
and skip.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_report import plot, report  # noqa: E402
from ddp_baseline import run_ddp  # noqa: E402
from hivemind_baseline import run_hivemind  # noqa: E402
from netns import HOST_IF, Namespaces, available  # noqa: E402

from p2pdiloco import localswarm  # noqa: E402
from p2pdiloco.localswarm import LocalSwarm  # noqa: E402
from p2pdiloco.metrics import read_metrics  # noqa: E402

PRESET = str(ROOT / "peers" / "tiny-cpu.toml")


@dataclass(frozen=True)
class Size:
    peers: int          # peers (and DDP ranks)
    steps: int          # inner steps per peer: the token budget
    duration: float     # seconds of training for the straggler comparison (a time budget)
    eval_batches: int   # held-out batches behind every eval loss
    parallel: int       # runs of one comparison at once (1 = clean timings)
    inner_steps: int    # H (the quality comparison also runs 2H)
    overhead_factor: int = 10  # the overhead comparison runs H and this many times H
    sweep_grid: tuple = ()  # (outer lr, outer momentum) cells of `sweep`; () = the whole grid below
    pace: float = 1.0   # quality runs: every peer sleeps to this slowdown (sleeping costs no CPU), so that on
                        # a crowded machine a peer's 60 steps still span several rounds of the other's
    byzantine_peers: int = 5          # `byzantine`: peers, the last one attacking (byzantine_collude: 2 more)
    byzantine_steps: int = 800        # inner steps per peer of each byzantine run (~75 s on 2 cores)
    byzantine_inner_steps: int = 20   # and its H
    byzantine_runs: tuple = ()        # (attack, rule) cells of `byzantine`; () = BYZANTINE_RUNS
    collusion_runs: tuple = ()        # the same for `byzantine_collude`; () = COLLUSION_RUNS
    long_h: bool = True               # `quality`: the pair at 2H too (the quick size leaves out this repeat of
                                      # the same code at another H: the suite's time)


SIZES = {
    "default": Size(peers=4, steps=1500, duration=150.0, eval_batches=16, parallel=1, inner_steps=50),
    # the suite's size: 4 rounds of H = 15; one sweep cell off the preset (the preset's own cell is the
    # ablation's "all" run)
    "quick": Size(peers=2, steps=60, duration=14.0, eval_batches=2, parallel=8, inner_steps=15, overhead_factor=1,
                  pace=3.0, sweep_grid=((0.5, 0.9),), long_h=False, byzantine_peers=3, byzantine_steps=30,
                  byzantine_inner_steps=10,
                  byzantine_runs=(("clean", "mean"), ("clean", "centered_clip"), ("control", "centered_clip"),
                                  ("signflip:5", "mean"), ("signflip:5", "centered_clip"), ("lie:4", "centered_clip"))),
    # issue 21: 8 peers on the same 2 cores; half the default steps per peer, so the swarm's tokens are the default
    # size's x 1 (4 x 1500 = 8 x 750), 15 outer steps at H=50
    "eight": Size(peers=8, steps=750, duration=150.0, eval_batches=16, parallel=1, inner_steps=50),
    # 120 outer steps of synchronous DiLoCo at H=50: long enough that DiLoCo's outer loop, not the budget, decides
    "long": Size(peers=4, steps=6000, duration=600.0, eval_batches=16, parallel=1, inner_steps=50),
}

# The decoupled swarm's mechanisms (config keys), each switched on and off for `bench.py ablation`:
# "all" is the defaults, "none" the first version (identical anchors, resync by download on a mismatch).
MECHANISMS = ("merge_anchors", "full_groups", "matchmaking_lead", "eager_outer", "dynamic_inner_steps", "schedule")
DEFAULTS = {"merge_anchors": True, "full_groups": True, "eager_outer": True, "schedule": True}
VARIANTS = {
    "none": {},
    "all": DEFAULTS,
    "no_schedule": {**DEFAULTS, "schedule": False},
    "no_merge": {**DEFAULTS, "merge_anchors": False},
    "no_full": {**DEFAULTS, "full_groups": False},
    "all_lead": {**DEFAULTS, "matchmaking_lead": True},
    "no_eager": {**DEFAULTS, "eager_outer": False},
    "all_dynamic": {**DEFAULTS, "dynamic_inner_steps": True},
    "all_share": {**DEFAULTS, "group_share": True},
    "all_mix": {**DEFAULTS, "eager_mix": True},
}


# `bench.py sweep`: the outer optimizer's grid, for both modes
SWEEP_OUTER_LR = (0.5, 0.7, 1.0)
SWEEP_OUTER_MOMENTUM = (0.6, 0.9)
# Synchronous DiLoCo, the baseline, runs at its own winner of that sweep (default size, H=50, seeds 0 and 1,
# docs/benchmarks.md §0), not at the decoupled swarm's preset: a baseline left untuned proves nothing
SYNC_OUTER = {"outer_lr": 1.0, "outer_momentum": 0.6}


# `bench.py byzantine`: what the attacking peer sends instead of its pseudo-gradient (P2PDILOCO_TEST_ATTACK,
# outer.attack_for_test), against each aggregation rule; "lie:4" is a reducer that returns -4 times its part
# of the average (allreduce.py), caught by check_reducers
# The list, then the strongest of each kind that stays inside the norm bound (10x the group median):
# with one attacker in five, the weaker ones move a mean by less than the run-to-run noise of this size
ATTACKS = ("signflip:1", "signflip:5", "alie:1", "alie:1.5", "ipm:0.1", "ipm:2", "noise", "ipm:4", "noise:9")
RULES = {"mean": {"aggregation": "mean", "check_reducers": False},
         "centered_clip": {"aggregation": "centered_clip", "check_reducers": True},
         # what the reducer check costs a clean swarm (--rules): the robust rule without it
         "centered_clip_unchecked": {"aggregation": "centered_clip", "check_reducers": False}}
BYZANTINE_RUNS = (*[(attack, rule) for attack in ("clean", *ATTACKS) for rule in ("mean", "centered_clip")],
                  ("lie:4", "centered_clip"), ("lie:4", "mean"))
# `bench.py byzantine_collude`: two attackers that send the same; the reference: every peer honest, under the mean
COLLUSION_RUNS = (("clean", "mean"), ("alie:1", "centered_clip"), ("signflip:5", "centered_clip"))
CLEAN = ("clean", "control")  # every peer honest; "control": without the attacker's peer (byzantine's reference)


def outlier_corpus(out: Path, size: int = 2_000_000) -> Path:
    """Text unlike the default corpus, for `byzantine`'s honest outlier: Python's own standard library
    (its .py files in a fixed order, up to `size` bytes), written once into out/."""
    path = out / "outlier.txt"
    if not path.exists():
        text, stdlib = [], Path(os.__file__).parent
        for source in sorted(stdlib.glob("*.py")):
            text.append(source.read_text(errors="replace"))
            if sum(map(len, text)) >= size:
                break
        path.write_text("".join(text)[:size])
    return path


def byzantine_name(attack: str, rule: str) -> str:
    """A run id's part: "signflip:5", "centered_clip" -> "signflip5_centered_clip" (no dots or colons)."""
    return f"{attack.replace(':', '').replace('.', 'p')}_{rule}"


def variant(name: str) -> dict:
    """A variant's overrides: its mechanisms on, the others off."""
    return {**{m: False for m in MECHANISMS}, **VARIANTS[name]}


class Bench:
    def __init__(self, out: Path, size: Size, *, seed: int, data: str, variants: tuple = tuple(VARIANTS),
                 extra: dict | None = None, baselines: bool = True):
        self.out, self.size, self.seed, self.data = out, size, seed, data
        self.variants, self.extra, self.baselines = variants, extra or {}, baselines

    def common(self, steps: int) -> dict:
        """Config shared by every run of a comparison: the lr schedule spans the budget."""
        return {"seed": self.seed, "threads": 1, "eval_batches": self.size.eval_batches, "log_interval": 2.0,
                "total_steps": max(steps, 60), "warmup_steps": min(50, steps // 2), "data": self.data,
                "inner_steps": self.size.inner_steps, "state_timeout": 3.0}

    # ------------------------------------------------------------------------------ runs

    def swarm(self, name: str, *, overrides: dict, per_peer: dict | None = None,
              per_peer_env: dict[int, dict] | None = None, outsiders: tuple = (), net: Namespaces | None = None,
              timeout: float = 1200, preset: str = PRESET, kill_at_step: int | None = None) -> dict:
        """A swarm of real `p2pdiloco join` processes that stop by themselves (max_inner_steps or
        max_time); returns its summary. per_peer: peer index -> extra overrides. per_peer_env: peer index ->
        environment variables of that peer alone (a test hook: P2PDILOCO_TEST_ATTACK). outsiders: peer
        indices (attackers) left out of the summary, whose exit codes are not checked; the summary names
        their peer ids. kill_at_step: the last peer is SIGKILLed (its whole process group: a crashed
        machine) once it logged that inner step."""
        workdir = self.out / "runs" / f"{name}-s{self.seed}"
        shutil.rmtree(workdir, ignore_errors=True)
        names = [chr(ord("a") + i) for i in range(self.size.peers)]
        # every peer starts training together (a peer that came up later must not miss the others)
        overrides = {"run_id": f"bench-{name}-s{self.seed}", "wait_for_peers": len(names), **overrides}
        peer_values = [{**overrides, **(per_peer or {}).get(i, {})} for i in range(len(names))]
        before = net.counters() if net else None
        with LocalSwarm(workdir, config=preset) as swarm:
            # every peer starts at once, through a DHT node that trains nothing
            swarm.start_bootstrap("boot", host=net.addr(0) if net else "127.0.0.1", wrapper=net.prefix(0) if net else ())
            env = swarm.env
            for i, (peer, values) in enumerate(zip(names, peer_values)):
                if net is not None:
                    values["host_maddrs"] = f"/ip4/{net.addr(i)}/tcp/0"
                args = [a for k, v in values.items() for a in _flag(k, v)]
                swarm.env = {**env, **(per_peer_env or {}).get(i, {})}
                swarm.start(peer, *args, join="boot", wrapper=net.prefix(i) if net else ())
            swarm.env = env
            t0, killed = time.monotonic(), names[-1] if kill_at_step else None
            if killed:
                swarm.wait_for(lambda: max([r["inner_step"] for r in swarm.events(killed, "inner")], default=0)
                               >= kill_at_step or swarm.peers[killed].proc.poll() is not None, timeout,
                               what=f"{name}: peer {killed} at inner step {kill_at_step}")
                swarm.signal(killed, signal.SIGKILL)
            swarm.wait_for(lambda: all(swarm.peers[p].proc.poll() is not None for p in names),
                           max(1.0, timeout - (time.monotonic() - t0)), what=f"{name}: every peer done")
            codes = swarm.stop_all()
            left_out = [names[i] for i in outsiders]
            failed = {peer: codes[peer] for peer in names if codes[peer] != 0 and peer != killed
                      and peer not in left_out}
            if failed:
                peer = next(iter(failed))
                raise RuntimeError(f"{name}: peers exited with {failed}: {swarm.stderr(peer, 600)}")
            records = {peer: read_metrics(swarm.peers[peer].log_dir / "metrics.jsonl") for peer in names}
        after = net.counters() if net else None
        slowdowns = {peer: float(values.get("slowdown", 1.0)) for peer, values in zip(names, peer_values)}
        preset_outer = tomllib.loads(Path(preset).read_text()).get("outer", {})
        outer = {k: overrides.get(k, preset_outer.get(k)) for k in ("outer_lr", "outer_momentum")}
        ids = {peer: next((r["peer"] for r in records[peer]), None) for peer in left_out}
        honest = {peer: recs for peer, recs in records.items() if peer not in left_out}
        settled = statistics.mean(settled_eval([r for r in honest[p] if r["event"] == "outer"], len(names))
                                  for p in honest)
        return {**summarize_swarm(name, honest, before, after, slowdowns), **outer, "killed": killed,
                "settled_eval": settled,
                "defence": defence(honest, set(ids.values())),
                **({"outsiders": {peer: {"peer_id": ids[peer], "exit_code": codes[peer]} for peer in left_out}}
                   if left_out else {})}

    def attempt(self, **kwargs) -> dict:
        """self.swarm, but a run that fails is a result ({"name", "error"}), not the end of its study: a
        swarm that an attack drives to divergence must not cost the other runs."""
        try:
            return self.swarm(**kwargs)
        except Exception as e:
            return {"name": kwargs["name"], "error": f"{type(e).__name__}: {e}"[:2000]}

    def ddp(self, name: str, *, steps: int, overrides: dict, net: Namespaces | None = None) -> dict:
        workdir = self.out / "runs" / f"{name}-s{self.seed}"
        shutil.rmtree(workdir, ignore_errors=True)
        before = net.counters() if net else None
        kwargs = {}
        if net is not None:
            kwargs = dict(prefixes=[net.prefix(i) for i in range(self.size.peers)], master_addr=net.addr(0),
                          ifname=HOST_IF)
        result = run_ddp(workdir, world_size=self.size.peers, config=PRESET, steps=steps,
                         overrides={k: v for k, v in overrides.items() if k != "inner_steps"},
                         eval_every=max(10, steps // 10), **kwargs)
        after = net.counters() if net else None
        return summarize_ddp(name, result, before, after)

    def hivemind_run(self, name: str, *, steps: int, overrides: dict, kill_at_step: int | None = None) -> dict:
        """hivemind.Optimizer peers (scripts/hivemind_baseline.py) on the same model, data and tokens."""
        workdir = self.out / "runs" / f"{name}-s{self.seed}"
        shutil.rmtree(workdir, ignore_errors=True)
        result = run_hivemind(workdir, peers=self.size.peers, config=PRESET, steps=steps,
                              inner_steps=overrides["inner_steps"], overrides=overrides, kill_at_step=kill_at_step,
                              run_id=f"bench-{name}-s{self.seed}", timeout=1200)
        return summarize_hivemind(name, result)

    def many(self, jobs: list) -> list[dict]:
        """Run (fn, kwargs) jobs, self.size.parallel at a time (a clean timing wants 1)."""
        with ThreadPoolExecutor(max_workers=self.size.parallel) as pool:
            return list(pool.map(lambda job: job[0](**job[1]), jobs))

    # ----------------------------------------------------------------------- comparisons

    def quality(self) -> dict:
        n, steps, H = self.size.peers, self.size.steps, self.size.inner_steps
        base = {**self.common(steps), "max_inner_steps": steps, "slowdown": self.size.pace}
        group = {"target_group_size": n}
        sync = {"sync_rounds": True, "min_group_size": n, **group, **SYNC_OUTER}
        jobs = [(self.ddp, dict(name="ddp", steps=steps, overrides=base)),
                (self.swarm, dict(name="sync_h50", overrides={**base, **sync})),
                (self.swarm, dict(name="decoupled_h50", overrides={**base, **group})),
                (self.swarm, dict(name="decoupled_h50_int8", overrides={**base, **group, "compression": "int8"})),
                (self.swarm, dict(name="decoupled_h50_int4", overrides={**base, **group, "compression": "int4"})),
                (self.swarm, dict(name="per_contribution_h50",
                                  overrides={**base, **group, "outer_apply": "per_contribution"}))]
        if self.size.long_h:
            jobs += [(self.swarm, dict(name="sync_h100", overrides={**base, **sync, "inner_steps": 2 * H})),
                     (self.swarm, dict(name="decoupled_h100", overrides={**base, **group, "inner_steps": 2 * H}))]
        runs = {r["name"]: r for r in self.many(jobs)}
        ddp = runs["ddp"]["final_eval"]
        gap = lambda a, b: 100 * (runs[a]["final_eval"] / b - 1)  # noqa: E731
        checks = [
            ("decoupled H=50 vs DDP", gap("decoupled_h50", ddp), 2.0),
            ("decoupled H=50 vs sync DiLoCo H=50", gap("decoupled_h50", runs["sync_h50"]["final_eval"]), 1.0),
            *([("decoupled H=100 vs DDP", gap("decoupled_h100", ddp), 2.0),
               ("decoupled H=100 vs sync DiLoCo H=100", gap("decoupled_h100", runs["sync_h100"]["final_eval"]), 1.0)]
              if self.size.long_h else []),
            ("int8 vs fp16 (decoupled H=50)", gap("decoupled_h50_int8", runs["decoupled_h50"]["final_eval"]), 0.5),
            ("int4 vs fp16 (decoupled H=50)", gap("decoupled_h50_int4", runs["decoupled_h50"]["final_eval"]), 0.5),
        ]
        control = gap("per_contribution_h50", runs["decoupled_h50"]["final_eval"])
        return {"runs": runs, "gaps_pct": [{"what": w, "pct": p, "target_pct": t, "met": p <= t} for w, p, t in checks],
                "negative_control": {"what": "Nesterov per contribution vs per group (H=50)", "pct": control,
                                     "seen": control > 1.0}}

    def ablation(self) -> dict:
        """Each variant of the decoupled swarm at H and 2H, next to synchronous DiLoCo on the same tokens
        (and DDP, once): final eval loss, applied rounds, full groups, merges, resyncs, anchor spread."""
        n, steps, H = self.size.peers, self.size.steps, self.size.inner_steps
        base = {**self.common(steps), "max_inner_steps": steps, "slowdown": self.size.pace, "target_group_size": n,
                **self.extra}
        jobs = [(self.ddp, dict(name="ddp", steps=steps, overrides=base))] if self.baselines else []
        for h in (H, 2 * H):
            if self.baselines:
                jobs.append((self.swarm, dict(name=f"sync_h{h}", overrides={
                    **base, **SYNC_OUTER, "inner_steps": h, "sync_rounds": True, "min_group_size": n,
                    **variant("none")})))
            jobs += [(self.swarm, dict(name=f"{v}_h{h}", overrides={**base, "inner_steps": h, **variant(v)}))
                     for v in self.variants]
        runs = {r["name"]: r for r in self.many(jobs)}
        if not self.baselines:  # compared with the baselines of another run of the same seeds
            return {"runs": runs, "gaps_pct": [], "variants": {v: variant(v) for v in self.variants}}
        gaps = [{"what": f"{name} vs sync_h{name.rsplit('_h', 1)[1]}",
                 "pct": 100 * (run["final_eval"] / runs[f"sync_h{name.rsplit('_h', 1)[1]}"]["final_eval"] - 1)}
                for name, run in runs.items() if name != "ddp" and not name.startswith("sync")]
        gaps += [{"what": f"sync_h{h} vs ddp", "pct": 100 * (runs[f"sync_h{h}"]["final_eval"] /
                                                            runs["ddp"]["final_eval"] - 1)} for h in (H, 2 * H)]
        return {"runs": runs, "gaps_pct": gaps, "variants": {v: variant(v) for v in self.variants}}

    def sweep(self) -> dict:
        """Tune both baselines before comparing them: final eval loss of synchronous DiLoCo and of the
        decoupled swarm (its default mechanisms) over outer_lr x outer_momentum, at H."""
        n, steps = self.size.peers, self.size.steps
        base = {**self.common(steps), "max_inner_steps": steps, "slowdown": self.size.pace, "target_group_size": n,
                **self.extra}
        modes = {"sync": {"sync_rounds": True, "min_group_size": n, **variant("none")}, "decoupled": {}}
        # run ids allow no dots: outer_lr 0.5 and momentum 0.9 name a run "..._lr0p5_m0p9"
        jobs = [(self.swarm, dict(name=f"{mode}_lr{lr:g}_m{mu:g}".replace(".", "p"),
                                  overrides={**base, **extra, "outer_lr": lr, "outer_momentum": mu}))
                for mode, extra in modes.items()
                for lr, mu in self.size.sweep_grid or itertools.product(SWEEP_OUTER_LR, SWEEP_OUTER_MOMENTUM)]
        runs = {r["name"]: r for r in self.many(jobs)}
        best = {mode: min((r for name, r in runs.items() if name.startswith(mode)),
                          key=lambda r: r["final_eval"])["name"] for mode in modes}
        return {"runs": runs, "best": best}

    def traffic(self) -> dict:
        ok, why = available()
        if not ok:
            return {"skipped": why}
        n, steps = self.size.peers, self.size.steps // 2
        base = {**self.common(steps), "max_inner_steps": steps, "target_group_size": n}
        runs = {}
        with Namespaces(n, tag="traffic") as net:  # one network at a time: its counters are per host
            runs["ddp"] = self.ddp("traffic_ddp", steps=steps, overrides=base, net=net)
            for codec in ("fp16", "int8", "int4"):
                runs[codec] = self.swarm(f"traffic_{codec}", overrides={**base, "compression": codec}, net=net)
        ddp_sent = runs["ddp"]["wire_sent_per_step"]
        H = base["inner_steps"]
        targets = {"fp16": 2 * H, "int4": 8 * H}
        ratios = []
        for codec in ("fp16", "int8", "int4"):
            ratio = ddp_sent / runs[codec]["wire_sent_per_step"]
            target = targets.get(codec)
            ratios.append({"codec": codec, "ratio_vs_fp32_ddp": ratio, "target": target,
                           "met": None if target is None else ratio >= target})
        return {"runs": runs, "ratios": ratios, "inner_steps": H}

    def stragglers(self) -> dict:
        n, duration = self.size.peers, self.size.duration
        # evaluating the anchor is not training: every 5th outer step keeps it ~1% of the time
        base = {**self.common(10**6), "max_time": duration, "target_group_size": n,
                "total_steps": int(duration * 15), "eval_every": 5}
        slow = {n - 1: {"slowdown": 4.0}}
        sync = {"sync_rounds": True, "min_group_size": n}
        runs = {r["name"]: r for r in self.many([
            (self.swarm, dict(name="straggler_decoupled", overrides=base, per_peer=slow)),
            (self.swarm, dict(name="straggler_sync", overrides={**base, **sync}, per_peer=slow))])}
        target = max(min(r["eval_curve_losses"] or [math.inf]) for r in runs.values()) * 1.02
        out = {"runs": runs, "target_loss": target}
        for mode, run in runs.items():
            run["time_to_target_s"] = time_to_loss(run, target)
            run["throughput_vs_own_speeds"] = run["swarm_tokens_per_s"] / run["sum_own_tokens_per_s"]
        out["met"] = runs["straggler_decoupled"]["throughput_vs_own_speeds"] >= 0.95
        return out

    def hetero(self) -> dict:
        """Heterogeneous peers at speeds 1, 1, 0.5 and 0.25 (slowdowns 1, 1, 2, 4), equal wall time:
        the decoupled swarm (defaults) against synchronous DiLoCo at its tuned outer optimizer. The
        figure: the decoupled swarm's time to sync's final eval loss over sync's time to it. Sync
        computes at 4 x 0.25 (everyone waits for the slowest), the swarm at 2.75: 1 / 2.75 = 0.36 is the
        limit."""
        n, duration = self.size.peers, self.size.duration
        base = {**self.common(10**6), "max_time": duration, "target_group_size": n,
                "total_steps": int(duration * 15), "eval_every": 2}
        slow = {i: {"slowdown": factor} for i, factor in zip(range(n - 1, -1, -1), (4.0, 2.0))}
        sync = {"sync_rounds": True, "min_group_size": n, **SYNC_OUTER}
        runs = {r["name"]: r for r in self.many([
            (self.swarm, dict(name="hetero_decoupled", overrides=base, per_peer=slow)),
            (self.swarm, dict(name="hetero_sync", overrides={**base, **sync}, per_peer=slow))])}
        dec, syn = runs["hetero_decoupled"], runs["hetero_sync"]
        target = min(syn["eval_curve_losses"] or [math.inf])  # sync's best (its final, as it only falls)
        t_sync, t_dec = time_to_loss(syn, target), time_to_loss(dec, target)
        ratio = t_dec / t_sync if t_dec is not None and t_sync else None
        minutes = range(60, int(duration) + 1, 60)
        by_minute = {name: [min([loss for _, t, loss in run["curve"] if t <= m] or [None], key=lambda x: x or math.inf)
                            for m in minutes] for name, run in runs.items()}
        return {"runs": runs, "target_loss": target, "time_to_target_s": {"sync": t_sync, "decoupled": t_dec},
                "time_ratio": ratio, "limit": 1 / 2.75, "target_ratio": 0.38,
                "met": ratio is not None and ratio <= 0.38, "eval_loss_by_minute": by_minute}

    def hivemind(self) -> dict:
        """The library a user would pick instead: hivemind.Optimizer with use_local_updates=True and
        target_batch_size = N x H x batch (local AdamW steps, parameters averaged once per epoch of
        about H steps per peer) against the decoupled swarm (its defaults), on the same model, data and
        tokens, fault-free and with the last peer SIGKILLed (its process group) at half its steps. Two
        numbers per pair: the eval loss at equal tokens (each run's final, the survivors' mean) and at
        equal wall time (each run's last eval loss by the faster run's end). --set applies to both
        (slowdown=N paces them: hivemind needs an epoch's compute well above a round)."""
        n, steps = self.size.peers, self.size.steps
        base = {**self.common(steps), "max_inner_steps": steps, "slowdown": self.size.pace, "target_group_size": n,
                **self.extra}
        half = steps // 2
        runs = {r["name"]: r for r in self.many([
            (self.swarm, dict(name="p2pdiloco", overrides=base)),
            (self.hivemind_run, dict(name="hivemind", steps=steps, overrides=base)),
            (self.swarm, dict(name="p2pdiloco_kill", overrides=base, kill_at_step=half)),
            (self.hivemind_run, dict(name="hivemind_kill", steps=steps, overrides=base, kill_at_step=half))])}
        pairs = []
        for suffix, fault in (("", "fault-free"), ("_kill", "one peer killed")):
            ours, theirs = runs[f"p2pdiloco{suffix}"], runs[f"hivemind{suffix}"]
            t = min(ours["wall_s"], theirs["wall_s"])
            for what, a, b in ((f"equal tokens, {fault}", ours["final_eval"], theirs["final_eval"]),
                               (f"equal wall time ({t:.0f} s), {fault}", loss_by(ours, t), loss_by(theirs, t))):
                pct = 100 * (a / b - 1) if a is not None and b else None
                pairs.append({"what": what, "p2pdiloco": a, "hivemind": b, "pct": pct,
                              "ahead": pct is not None and pct < 0})
        return {"runs": runs, "pairs": pairs, "met": all(p["ahead"] for p in pairs)}

    def byzantine(self, colluders: int = 1) -> dict:
        """Untrusted volunteers: a swarm of byzantine_peers (default mechanisms) whose last `colluders` peers
        attack (P2PDILOCO_TEST_ATTACK, the same attack each), under hivemind's weighted mean and under
        centered clipping with the reducer check. Each run's summary covers the honest peers only (an
        attacker's own model is honest; its eval is not the swarm's), plus their defence counts (clipped
        senders, bans, reducer checks). The figure: final eval loss over that of the clean swarm under the
        mean (every peer honest: an attack also costs the attacker's share of the tokens)."""
        n = self.size.byzantine_peers + 2 * (colluders - 1)  # 5 peers with one attacker, 7 with two
        crowd = Bench(self.out, replace(self.size, peers=n, inner_steps=self.size.byzantine_inner_steps),
                      seed=self.seed, data=self.data)
        steps = self.size.byzantine_steps
        base = {**crowd.common(steps), "max_inner_steps": steps, "target_group_size": n, **self.extra}
        attackers = tuple(range(n - colluders, n))
        # "control": the honest peers alone (N - colluders clean peers, the same inner steps each), the reference of
        # an attacked swarm's final eval: what the honest peers reach without the attacker's rounds or its tokens
        control = Bench(self.out, replace(crowd.size, peers=n - colluders), seed=self.seed, data=self.data)
        cells = ((self.size.collusion_runs or COLLUSION_RUNS) if colluders > 1
                 else self.size.byzantine_runs or BYZANTINE_RUNS)
        # "outlier": the last peer is honest but trains on other text (a persistent honest outlier): a ban of it is
        # a false ban; it stays out of the summary like an attacker (its eval is on its own data)
        other = outlier_corpus(self.out) if any(attack == "outlier" for attack, _ in cells) else None
        jobs = [((control if attack == "control" else crowd).attempt, dict(
            name=byzantine_name(attack, rule) + (f"_x{colluders}" if colluders > 1 else ""),
            overrides={**base, **RULES[rule], **({"target_group_size": n - colluders} if attack == "control" else {})},
            per_peer={i: {"data": str(other)} for i in attackers} if attack == "outlier" else None,
            per_peer_env={} if attack in (*CLEAN, "outlier")
            else {i: {"P2PDILOCO_TEST_ATTACK": attack} for i in attackers},
            outsiders=() if attack in CLEAN else attackers)) for attack, rule in cells]
        by_cell = {(attack, rule): {**run, "attack": attack, "rule": rule,
                                    "colluders": 0 if attack in CLEAN else colluders}
                   for (attack, rule), run in zip(cells, crowd.many(jobs))}
        return byzantine_result(by_cell, colluders, n)

    def byzantine_collude(self) -> dict:
        """`byzantine` with two attackers (2 more peers) that send the same crafted pseudo-gradient."""
        return self.byzantine(colluders=2)

    def slowlinks(self, rate_mbit: float = 50.0) -> dict:
        ok, why = available()
        if not ok:
            return {"skipped": why}
        n, steps = self.size.peers, self.size.steps // 2
        base = {**self.common(steps), "max_inner_steps": steps, "target_group_size": n, "eval_every": 5}
        with Namespaces(n, rate_mbit=rate_mbit, tag="slow") as net:
            runs = {"ddp": self.ddp("slow_ddp", steps=steps, overrides=base, net=net),
                    "p2pdiloco": self.swarm("slow_p2pdiloco", overrides=base, net=net)}
        util = runs["p2pdiloco"]["compute_utilization"]
        return {"runs": runs, "rate_mbit": rate_mbit, "utilization": util, "met": util >= 0.97,
                "speedup_vs_ddp": runs["ddp"]["wall_s"] / runs["p2pdiloco"]["wall_s"]}

    def overhead(self) -> dict:
        """Two peers in a swarm vs two bare loops at once (the same CPU contention), at H and 10 H:
        each round costs CPU in the background processes (DHT, averager, p2pd), so the overhead
        falls as rounds get rarer."""
        pair = Bench(self.out, replace(self.size, peers=2), seed=self.seed, data=self.data)
        by_h = {}
        # overhead_factor 1 (the quick size): H only
        for H in dict.fromkeys((self.size.inner_steps, self.size.overhead_factor * self.size.inner_steps)):
            steps = max(self.size.steps, 3 * H)
            base = {**self.common(steps), "max_inner_steps": steps, "eval_batches": 1, "eval_every": 10**6,
                    "inner_steps": H}
            run = pair.swarm(f"overhead_swarm_h{H}", overrides={**base, "target_group_size": 2})
            bare = bare_loops(2, steps, base)
            peer_step = statistics.mean(p["wall_s"] / p["inner_step"] for p in run["peers"].values())
            bare_step = statistics.mean(b["wall_s"] / b["steps"] for b in bare)
            pct = 100 * (peer_step / bare_step - 1)
            by_h[H] = {"swarm": run, "bare": bare, "peer_step_ms": 1e3 * peer_step, "bare_step_ms": 1e3 * bare_step,
                       "rounds_per_peer": statistics.mean(p["outer_steps_applied"] for p in run["peers"].values()),
                       "overhead_pct": pct, "met": pct <= 3.0}
        return {"by_inner_steps": by_h}

    def gpu(self) -> dict:
        """On a CUDA machine: 2 small-gpu peers (both on this machine's GPUs) for `duration` seconds,
        then 2 bare loops for as many steps: inner tokens/s, MFU and the overhead."""
        import torch

        if not torch.cuda.is_available():
            return {"skipped": "no CUDA device"}
        preset = str(ROOT / "peers" / "small-gpu.toml")
        cfg = {"seed": self.seed, "host_maddrs": "/ip4/127.0.0.1/tcp/0", "max_time": self.size.duration,
               "state_timeout": 10.0, "eval_batches": 2, "log_interval": 10.0, "data": self.data,
               "target_group_size": 2}
        pair = Bench(self.out, replace(self.size, peers=2), seed=self.seed, data=self.data)
        run = pair.swarm("gpu_swarm", overrides=cfg, preset=preset, timeout=self.size.duration + 600)
        steps = min(p["inner_step"] for p in run["peers"].values())
        bare = bare_loops(2, steps, {k: v for k, v in cfg.items() if k not in ("max_time", "host_maddrs")}, preset)
        peer_step = statistics.mean(p["wall_s"] / p["inner_step"] for p in run["peers"].values())
        bare_step = statistics.mean(b["wall_s"] / b["steps"] for b in bare)
        from p2pdiloco.config import Config

        model_cfg = Config.from_sources(preset, {"data": self.data} if self.data else {})  # the data's vocabulary
        tokens_per_s = [p["tokens"] / p["wall_s"] for p in run["peers"].values()]
        flops = flops_per_token(model_cfg)
        peak = peak_flops(torch.cuda.get_device_name())
        # where each peer's wall time went (the first GPU run: 0.68 in inner steps, the rest unexplained), and
        # the training thread's time at each round boundary (the `boundary` records)
        split = {name: {what: p[f"{what}_s"] / p["wall_s"] for what in ("compute", "data", "outer", "eval")}
                 for name, p in run["peers"].items()}
        # one peer alone (no rounds), compiled, fused AdamW, against the same bare loop alone
        solo = Bench(self.out, replace(self.size, peers=1), seed=self.seed, data=self.data).swarm(
            "gpu_solo", overrides={**cfg, "max_time": min(60.0, self.size.duration)}, preset=preset, timeout=600)
        solo_peer = next(iter(solo["peers"].values()))
        bare_solo = bare_loops(1, solo_peer["inner_step"], {k: v for k, v in cfg.items()
                                                           if k not in ("max_time", "host_maddrs")}, preset)[0]
        # after warm-up (compilation): the peer's later log intervals, the bare loop past its first steps
        inner = [r["tokens_per_s"] for path in (self.out / "runs" / f"gpu_solo-s{self.seed}").glob("*/metrics.jsonl")
                 for r in read_metrics(path) if r["event"] == "inner"]
        solo_tps = statistics.median(inner[len(inner) // 2:]) if inner else solo_peer["tokens"] / solo_peer["wall_s"]
        tokens_per_step = solo_peer["tokens"] / max(1, solo_peer["inner_step"])
        bare_tps = tokens_per_step * bare_solo["warm_steps"] / bare_solo["warm_s"]
        return {"time_split": split, "swarm": run, "bare": bare, "device": torch.cuda.get_device_name(),
                "solo": {"inner_tokens_per_s": solo_tps, "bare_tokens_per_s": bare_tps,
                         "mfu": solo_tps * flops / peak if peak else None,
                         "bare_mfu": bare_tps * flops / peak if peak else None},
                "inner_tokens_per_s": tokens_per_s, "flops_per_token": flops, "peak_flops": peak,
                "mfu": [t * flops / peak for t in tokens_per_s] if peak else None,
                "peer_step_ms": 1e3 * peer_step, "bare_step_ms": 1e3 * bare_step,
                "overhead_pct": 100 * (peer_step / bare_step - 1)}


def flops_per_token(cfg) -> float:
    """Training FLOPs per token: 6 N (weights) + 12 L d T (attention), as in the PaLM appendix."""
    d, L, T, V = cfg.n_embd, cfg.n_layer, cfg.block_size, cfg.vocab_size
    params = L * 12 * d * d + V * d + T * d
    return 6 * params + 12 * L * d * T


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak of known GPUs (vendor datasheets); P2PDILOCO_PEAK_TFLOPS overrides."""
    import os

    if os.environ.get("P2PDILOCO_PEAK_TFLOPS"):
        return float(os.environ["P2PDILOCO_PEAK_TFLOPS"]) * 1e12
    table = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "4090": 165e12}
    return next((v for k, v in table.items() if k in device_name), None)


def _flag(key: str, value) -> list[str]:
    flag = key.replace("_", "-")
    if isinstance(value, bool):
        return [f"--{flag}" if value else f"--no-{flag}"]
    return [f"--{flag}", str(value)]


# --------------------------------------------------------------------------- summaries

def summarize_swarm(name: str, records: dict, before, after, slowdowns: dict) -> dict:
    peers, contributions = {}, []
    for peer, recs in records.items():
        final = next((r for r in recs if r["event"] == "final"), None)
        if final is None:  # a peer the benchmark SIGKILLed: its evaluations stay in the curve below
            continue
        outer = [r for r in recs if r["event"] == "outer"]
        tokens_per_step = final["tokens"] / max(1, final["inner_step"])
        contributions += [r["tokens"] / tokens_per_step for r in outer if r.get("tokens")]
        # metrics log a non-finite loss as None: a diverged peer's final eval is inf
        final_eval = math.inf if final["eval_loss"] is None else final["eval_loss"]
        # the model the peer keeps (the anchors' average; the anchor itself with anchor_average = 0)
        kept_eval = final_eval if "kept_eval_loss" not in final else (
            math.inf if final["kept_eval_loss"] is None else final["kept_eval_loss"])
        peers[peer] = {"final_eval": final_eval, "kept_eval": kept_eval, "tokens": final["tokens"],
                       "inner_step": final["inner_step"],
                       "outer_steps_applied": len(outer), "wall_s": final["wall_s"], "compute_s": final["compute_s"],
                       "data_s": final.get("data_s"), "outer_s": final.get("outer_s"), "eval_s": final.get("eval_s"),
                       "final_wait_s": final.get("final_wait_s", 0.0), "end": final["time"],
                       "start": final["time"] - final["wall_s"] - final.get("final_wait_s", 0.0),
                       "rounds_failed": sum(r["event"] == "round_failed" for r in recs),
                       "resyncs": sum(r["event"] == "resync" for r in recs),
                       "merges": sum(bool(r.get("merged")) for r in outer),
                       "full_rounds": sum(r["group_size"] >= r.get("swarm_size", 0) for r in outer),
                       "max_eval_jump_pct": max_eval_jump(outer),
                       "end_of_run_pct": end_of_run_pct(outer, kept_eval, peers=len(records)),
                       "anchor_end_of_run_pct": end_of_run_pct(outer, final_eval, peers=len(records)),
                       "msg_bytes_sent": sum(r["bytes_sent"] for r in outer),
                       "msg_bytes_recv": sum(r["bytes_recv"] for r in outer)}
    start, end = min(p["start"] for p in peers.values()), max(p["end"] for p in peers.values())
    round_s = [r["round_s"] for recs in records.values() for r in recs if r["event"] == "outer" and r.get("round_s")]
    # a SIGKILLed peer's tokens up to its last record count too: they are in the swarm's curve
    tokens = sum(p["tokens"] for p in peers.values()) + sum(
        max([r["tokens"] for r in recs if r["event"] == "inner"], default=0)
        for peer, recs in records.items() if peer not in peers)
    steps = sum(p["inner_step"] for p in peers.values())
    curve = swarm_curve(records, start)
    out = {"name": name, "kind": "p2pdiloco", "final_eval": statistics.mean(p["final_eval"] for p in peers.values()),
           "kept_eval": statistics.mean(p["kept_eval"] for p in peers.values()),
           "tokens": tokens, "wall_s": end - start, "swarm_tokens_per_s": tokens / (end - start),
           "sum_own_tokens_per_s": sum(p["tokens"] / (p["compute_s"] * slowdowns[k]) for k, p in peers.items()),
           "compute_utilization": statistics.mean(p["compute_s"] / p["wall_s"] for p in peers.values()),
           "curve": curve, "eval_curve_losses": [c[2] for c in curve], "peers": peers,
           "msg_sent_per_step": sum(p["msg_bytes_sent"] for p in peers.values()) / steps,
           "round_s": statistics.mean(round_s) if round_s else None,
           "round_s_median": statistics.median(round_s) if round_s else None,
           "rounds_per_min": 60 * len(round_s) / len(records) / (end - start) if round_s else None}
    applied = sum(p["outer_steps_applied"] for p in peers.values())
    # a contribution's time (its median inner steps at the median peer's own rate) over the median round's:
    # the ratio of compute to communication, as scale.py swarm measures it
    rates = [p["inner_step"] / p["wall_s"] for p in peers.values() if p["wall_s"] > 0]
    if contributions and rates and round_s:
        out["ratio"] = statistics.median(contributions) / statistics.median(rates) / statistics.median(round_s)
    out.update(full_group_fraction=sum(p["full_rounds"] for p in peers.values()) / max(1, applied),
               resyncs=sum(p["resyncs"] for p in peers.values()), merges=sum(p["merges"] for p in peers.values()),
               max_eval_jump_pct=max(p["max_eval_jump_pct"] for p in peers.values()),
               end_of_run_pct=max((p["end_of_run_pct"] for p in peers.values() if p["end_of_run_pct"] is not None),
                                  default=None),
               anchor_end_of_run_pct=max((p["anchor_end_of_run_pct"] for p in peers.values()
                                          if p["anchor_end_of_run_pct"] is not None), default=None),
               anchor_spread=anchor_spread_over_time(records),
               # inner steps behind each applied contribution (the schedule's target: inner_steps, +-10%)
               contribution_steps=quantiles(contributions))
    killed = [recs for peer, recs in records.items() if peer not in peers and recs]
    if killed:  # back in phase: rounds each survivor took after the kill until one held every survivor
        out["rounds_to_full_after_kill"] = rounds_to_full(records, set(peers), max(r["time"] for r in killed[0]))
    out.update(_wire(before, after, steps))
    return out


def defence(records: dict, attackers: set) -> dict:
    """What the (honest) peers' records say of the defences, summed over peers: senders their reducers
    clipped (attackers' and honest ones: false alarms), bans, and each reducer check (an event per peer
    per round) of a group that held an attacker: how many caught it. Events a version without the robust
    rule does not log count 0."""
    events = [r for recs in records.values() for r in recs]
    clipped = [r for r in events if r["event"] == "bad_contribution" and str(r.get("reason", "")).startswith("clipped")]
    anchors = [r for r in events if r["event"] == "bad_contribution"
               and str(r.get("reason", "")).startswith("its anchor or momentum clipped")]
    banned = [r for r in events if r["event"] == "banned"]
    checked = [r for r in events if r["event"] == "reducer_check" and attackers & set(r.get("members") or ())]
    caught = sum(bool(attackers & set(r.get("bad") or ())) for r in checked)
    # per applied round at each honest peer's reducer: the share of the honest senders' pseudo-gradients that
    # clipping took (1 - factor, averaged over the honest members of the group)
    short = {a[-6:] for a in attackers}
    taken = []
    for r in events:
        if r["event"] == "outer" and isinstance(r.get("clipped"), dict) and r.get("members"):
            honest = [m for m in r["members"] if m not in short]
            taken.append(sum(1.0 - r["clipped"].get(m, 1.0) for m in honest) / max(1, len(honest)))
    # the honest peers' rounds before the first ban of an attacker and after the last one (every honest peer
    # banned it by then): median round time and the share that held every honest peer
    bans = [r["time"] for r in banned if r.get("sender") in attackers]
    outer = [r for r in events if r["event"] == "outer" and r.get("round_s")]
    phases = {"during": [r for r in outer if bans and r["time"] < min(bans)],
              "after_ban": [r for r in outer if bans and r["time"] > max(bans)]}
    rounds = {phase: {"median_s": statistics.median(r["round_s"] for r in recs),
                      "whole": sum(r["group_size"] >= len(records) for r in recs) / len(recs), "rounds": len(recs)}
              for phase, recs in phases.items() if recs}
    return {"clipped_attacker": sum(r.get("sender") in attackers for r in clipped),
            "rounds": rounds,
            "clipped_honest": sum(r.get("sender") not in attackers for r in clipped),
            "anchor_clipped_honest": sum(r.get("sender") not in attackers for r in anchors),
            "honest_clip_share": {"mean": sum(taken) / len(taken), **quantiles(taken), "max": max(taken),
                                  "rounds": len(taken)} if taken else None,
            "banned_attacker": sum(r.get("sender") in attackers for r in banned),
            "banned_honest": sum(r.get("sender") not in attackers for r in banned),
            "reducer_check": {"rounds": len(checked), "caught": caught,
                              "rate": caught / len(checked) if checked else None}}


def loss_ratio(run: dict, ref: dict | None):
    """run's settled eval loss over ref's; a diverged run (non-finite loss) is inf; None if either failed."""
    if ref is None or "error" in run or "error" in ref:
        return None
    loss = run["settled_eval"]
    return loss / ref["settled_eval"] if loss is not None and math.isfinite(loss) else math.inf


def final_ratio(run: dict, ref: dict):
    """run's final eval loss of the model each honest peer keeps (the anchors' average), their mean, over
    ref's; inf if run diverged, None if either failed."""
    key = "kept_eval" if "kept_eval" in run and "kept_eval" in ref else "final_eval"  # results of older runs
    if "error" in run or "error" in ref or not ref.get(key):
        return None
    loss = run[key]
    return loss / ref[key] if loss is not None and math.isfinite(loss) else math.inf


def end_of_run_pct(outer: list, final_eval: float, *, peers: int) -> float | None:
    """How much worse a peer's final model (final_eval: its kept model's, or its anchor's) is than the last
    anchor a group of every peer of the run produced (%): what the groups of the end of a run, formed as the
    others stop, did to the model a user keeps. None without an evaluated whole group."""
    whole = [r["eval_loss"] for r in outer if r["group_size"] >= peers and r.get("eval_loss") is not None]
    if not whole or not whole[-1]:
        return None
    return 100 * (final_eval / whole[-1] - 1) if math.isfinite(final_eval) else math.inf


def settled_eval(outer: list, peers: int) -> float:
    """A peer's eval loss at its last outer step whose group held a majority of the swarm's peers (inf if
    it diverged). What comes after is the end of a run: groups of 2 or 3 that form once the others have
    stopped, whose last outer step raised the loss by up to 0.7 nats under either rule (docs/security.md)."""
    kept = [r for r in outer if 2 * r["group_size"] > peers]
    loss = kept[-1].get("eval_loss") if kept else None
    return math.inf if loss is None or not math.isfinite(loss) else loss


def byzantine_result(by_cell: dict, colluders: int, peers: int) -> dict:
    """`bench.py byzantine`'s figures from its runs ((attack, rule) -> summary): each run's settled eval over
    the clean swarm's under the mean, and the issue's targets."""
    ref = by_cell.get(("clean", "mean"))
    for (attack, rule), run in by_cell.items():
        run["ratio"] = loss_ratio(run, ref)
        control = by_cell.get(("control", rule))
        if control is not None and attack not in CLEAN:  # the model the honest peers keep, against their swarm alone
            run["final_vs_control"] = final_ratio(run, control)
    runs = {run["name"]: run for run in by_cell.values()}

    def check(what: str, value, op: str, target: float) -> dict:
        met = None if value is None else (value <= target if op == "<=" else value >= target)
        return {"what": what, "value": value, "target": f"{op} {target:g}", "met": met}

    checks = [check(f"{attack} ({rule}): the honest peers' kept model / their clean swarm's alone (control), "
                    "final eval",
                    r["final_vs_control"], "<=", 1.03)
              for (attack, rule), r in by_cell.items() if "final_vs_control" in r]
    checks += [check(f"{attack} ({rule}): the worst honest kept model over the last whole group's anchor (%)",
                     r.get("end_of_run_pct"), "<=", 0.5) for (attack, rule), r in by_cell.items() if "error" not in r]
    if colluders > 1:
        checks += [check(f"{attack} by {colluders} colluders, centered_clip: settled eval / clean mean's",
                         r["ratio"], "<=", 1.05) for (attack, rule), r in by_cell.items() if attack not in CLEAN]
        return {"runs": runs, "checks": checks, "colluders": colluders, "peers": peers}
    mean_runs = [by_cell[a, "mean"]["ratio"] for a in ATTACKS if (a, "mean") in by_cell]
    if mean_runs:
        degraded = sum(r is not None and r >= 1.1 for r in mean_runs)
        checks.append(check(f"mean: attacks that degrade it >= 1.1x (of {len(mean_runs)})", degraded, ">=",
                            min(3, len(mean_runs))))
    checks += [check(f"centered_clip under {attack}: settled eval / clean mean's", r["ratio"], "<=", 1.02)
               for (attack, rule), r in by_cell.items() if rule == "centered_clip" and attack not in CLEAN]
    ref = by_cell.get(("clean", "mean"))
    for rule in ("centered_clip", "centered_clip_unchecked"):
        clean = by_cell.get(("clean", rule))
        if clean is None:
            continue
        checks.append(check(f"clean {rule}: settled eval / clean mean's", clean["ratio"], "<=", 1.01))
        rounds = [clean.get("round_s"), (ref or {}).get("round_s")]  # None: a failed run, or no round
        time_ratio = rounds[0] / rounds[1] if all(rounds) else None
        checks.append(check(f"clean {rule}: round time / clean mean's", time_ratio, "<=", 1.15))
    for (attack, rule), r in by_cell.items():
        if attack.startswith("lie:") and RULES[rule]["check_reducers"]:
            checks.append(check(f"{attack} ({rule}): its rounds in which the reducer check caught it",
                                (r.get("defence") or {}).get("reducer_check", {}).get("rate"), ">=", 0.95))
    return {"runs": runs, "checks": checks, "colluders": colluders, "peers": peers}


def rescore(results: dict, out: Path) -> None:
    """Recompute the byzantine studies' settled evals (from the runs' metrics kept in out/runs) and figures."""
    for seed, comps in results["by_seed"].items():
        for comp in ("byzantine", "byzantine_collude"):
            study = comps.get(comp)
            if not study or "runs" not in study:
                continue
            for run in study["runs"].values():
                workdir = out / "runs" / f"{run['name']}-s{seed}"
                if "error" in run or not workdir.exists():
                    continue
                outsiders = set(run.get("outsiders") or ())
                logs = [p for p in sorted(workdir.iterdir()) if (p / "metrics.jsonl").exists()]
                evals = [settled_eval([r for r in read_metrics(p / "metrics.jsonl") if r["event"] == "outer"],
                                      len(logs)) for p in logs if p.name not in outsiders]
                run["settled_eval"] = statistics.mean(evals)
            by_cell = {(r["attack"], r["rule"]): r for r in study["runs"].values()}
            comps[comp] = byzantine_result(by_cell, study["colluders"], study["peers"])


def rounds_to_full(records: dict, survivors: set, kill_t: float) -> dict:
    """Per survivor: its rounds (applied or failed) after kill_t up to and including the first applied
    one that held every survivor (None: none did). The kill time is the dead peer's last record, so
    a round already running then may count too."""
    out = {}
    for peer in sorted(survivors):
        rounds = [r for r in records[peer] if r["event"] in ("outer", "round_failed") and r["time"] > kill_t]
        out[peer] = next((i for i, r in enumerate(rounds, start=1)
                          if r["event"] == "outer" and r["group_size"] >= len(survivors)), None)
    return out


def quantiles(values: list) -> dict:
    """Median and 90th percentile (None without values)."""
    if not values:
        return {"median": None, "p90": None}
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}


def max_eval_jump(outer: list, after_step: int = 5) -> float:
    """The largest rise of the anchor's eval loss between two consecutive evaluated outer steps of a
    peer, in percent, once past the first `after_step` outer steps (warmup)."""
    evals = [r["eval_loss"] for r in outer if r.get("eval_loss") is not None and r["outer_step"] > after_step]
    return max([100 * (b / a - 1) for a, b in zip(evals, evals[1:])], default=0.0)


def anchor_spread_over_time(records: dict, tolerance: float = 1e-3) -> dict:
    """Agreement of the peers' anchors over the run: for every outer step that two or more peers
    applied, the largest digest spread (diloco.digest_spread) between their anchors at that step;
    `agree` is the fraction of those steps on which all of them agreed within `tolerance`."""
    from p2pdiloco.diloco import digest_spread

    by_step: dict = {}
    for recs in records.values():
        for r in recs:
            if r["event"] == "outer" and r.get("digest"):
                by_step.setdefault(r["outer_step"], []).append(r["digest"])
    spreads = sorted(max(digest_spread(a, b) for i, a in enumerate(ds) for b in ds[i + 1:])
                     for ds in by_step.values() if len(ds) >= 2)
    if not spreads:
        return {"median": None, "p90": None, "max": None, "agree": None}
    return {"median": spreads[len(spreads) // 2], "p90": spreads[int(0.9 * (len(spreads) - 1))],
            "max": spreads[-1], "agree": sum(v <= tolerance for v in spreads) / len(spreads)}


def swarm_curve(records: dict, start: float) -> list:
    """(swarm tokens, seconds, eval loss) at every applied outer step of every peer, in time order."""
    inner = {peer: [(r["time"], r["tokens"]) for r in recs if r["event"] == "inner"] for peer, recs in records.items()}

    def tokens_at(t: float) -> int:
        return sum(max([tok for (tt, tok) in points if tt <= t], default=0) for points in inner.values())

    points = [(r["time"], r["eval_loss"]) for recs in records.values() for r in recs if r["event"] == "outer"]
    return [(tokens_at(t), t - start, loss) for t, loss in sorted(points) if loss is not None]


def summarize_ddp(name: str, result: dict, before, after) -> dict:
    final = result["final"]
    ranks = result["ranks"]
    evals = [r for r in ranks[0] if r["event"] == "eval"]
    steps = sum(next(r for r in recs if r["event"] == "final")["inner_step"] for recs in ranks)
    wall = final["wall_s"]
    out = {"name": name, "kind": "ddp", "final_eval": final["eval_loss"], "tokens": final["tokens"], "wall_s": wall,
           "swarm_tokens_per_s": final["tokens"] / wall,
           "curve": [(r["tokens"], r["time"] - (final["time"] - wall), r["eval_loss"]) for r in evals]
           + [(final["tokens"], wall, final["eval_loss"])]}
    out["eval_curve_losses"] = [c[2] for c in out["curve"]]
    out.update(_wire(before, after, steps))
    return out


def summarize_hivemind(name: str, result: dict) -> dict:
    """The hivemind run as the swarm's summary reads: final eval (the survivors' mean), tokens of every
    peer (a killed one's up to its last record), wall time from the first start line to the last step,
    and the curve of every peer's epoch evaluations (its local model, as the epoch's round is in flight),
    placed on the tokens axis at that peer's tokens x the number of peers (hivemind's peers keep about
    the same pace: an epoch ends for all of them at once)."""
    finals = result["final"]
    records = [r for recs in result["ranks"] for r in recs]
    start = min(r["time"] for r in records if r["event"] == "start")
    end = max(f["time"] - f["final_wait_s"] for f in finals)
    tokens = sum(max([r["tokens"] for r in recs if r["event"] in ("inner", "final")], default=0)
                 for recs in result["ranks"])
    curve = [(r["tokens"] * len(result["ranks"]), r["time"] - start, r["eval_loss"])
             for r in sorted(records, key=lambda r: r["time"]) if r["event"] == "epoch" and "eval_loss" in r]
    curve += [(f["tokens"] * len(result["ranks"]), f["time"] - f["final_wait_s"] - start, f["eval_loss"])
              for f in sorted(finals, key=lambda f: f["time"])]
    return {"name": name, "kind": "hivemind", "final_eval": result["eval_loss"], "tokens": tokens,
            "wall_s": end - start, "curve": curve, "eval_curve_losses": [c[2] for c in curve],
            "killed": result["killed"], "epochs": [f["epochs"] for f in finals],
            "rounds_averaged": [f["rounds_averaged"] for f in finals],
            "rounds_failed": [f["rounds_failed"] for f in finals],
            "group_sizes": [f["group_sizes"] for f in finals]}


def loss_by(run: dict, t: float):
    """The run's last eval loss at or before t seconds (None if it evaluated nothing by then)."""
    losses = [loss for _, tt, loss in run["curve"] if tt <= t + 1e-6 and loss is not None]
    return losses[-1] if losses else None


def _wire(before, after, steps: int) -> dict:
    """Bytes at each host's interface (netns counters) per inner step, averaged over peers."""
    if before is None:
        return {}
    n = len(before)
    sent = sum(a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before))
    recv = sum(a["rx_bytes"] - b["rx_bytes"] for a, b in zip(after, before))
    return {"wire_sent_per_step": sent / steps, "wire_recv_per_step": recv / steps, "wire_hosts": n}


def time_to_loss(run: dict, target: float):
    return next((t for _, t, loss in run["curve"] if loss <= target), None)


# ------------------------------------------------------------------------- bare loop

def bare_loops(count: int, steps: int, overrides: dict, preset: str = PRESET) -> list[dict]:
    """`count` bare torch loops at once (subprocesses), each the peer's inner step and nothing else."""
    procs = []
    try:
        for i in range(count):
            cmd = [sys.executable, __file__, "_bare", "--steps", str(steps), "--seed", str(i),
                   "--overrides", json.dumps(overrides), "--preset", preset]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        results, deadline = [], time.monotonic() + 600
        for p in procs:
            while True:  # a second at a time: bench.py's SIGTERM may come (localswarm.STOPPING)
                localswarm.raise_if_stopping()
                try:
                    out, err = p.communicate(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline:
                        raise
            if p.returncode != 0:
                raise RuntimeError(f"bare loop failed: {err[-600:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def bare_main(steps: int, seed: int, overrides: dict, preset: str = PRESET) -> None:
    """The inner step of Peer._train, alone: same model, batch, AdamW (fused on CUDA), schedule, clipping,
    torch.compile setting, pinned batches, and no device sync per step (one at the end)."""
    import torch

    from p2pdiloco import diloco
    from p2pdiloco.config import Config
    from p2pdiloco.data import load_data
    from p2pdiloco.model import GPT
    from p2pdiloco.device import pick_device

    cfg = Config.from_sources(preset, {k: v for k, v in overrides.items() if k != "max_inner_steps"})
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    device = pick_device(cfg.device)
    data = load_data(cfg, progress=lambda m: None)
    torch.manual_seed(cfg.seed)
    model = GPT.from_config(cfg).to(device)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner_lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95),
                            fused=cuda)
    step_model = torch.compile(model) if cfg.compile == "on" or (cfg.compile == "auto" and cuda) else model
    gen = torch.Generator().manual_seed(seed)
    model.train()
    t0 = time.monotonic()
    warmup, t_warm = min(10, steps // 4), None  # compilation and allocator warm-up: timed apart
    for step in range(steps):
        if step == warmup:
            if cuda:
                torch.cuda.synchronize(device)
            t_warm = time.monotonic()
        lr = diloco.inner_lr_at(step, inner_lr=cfg.inner_lr, warmup_steps=cfg.warmup_steps,
                                total_steps=cfg.total_steps, min_lr_ratio=cfg.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = data.train_batch(cfg.batch_size, gen)
        x, y = (t.pin_memory().to(device, non_blocking=True) if cuda else t for t in batch)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = step_model(x, y)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize(device)
    end = time.monotonic()
    print(json.dumps({"steps": steps, "wall_s": end - t0, "warm_steps": steps - warmup,
                      "warm_s": end - (t_warm or t0), "loss": float(loss)}))


# ------------------------------------------------------------------------------ main

COMPARISONS = ("quality", "traffic", "stragglers", "slowlinks", "overhead")  # what `all` runs
# the decoupled swarm's mechanisms, the outer optimizer's tuning, heterogeneous peers, hivemind.Optimizer,
# untrusted volunteers
STUDIES = ("ablation", "sweep", "hetero", "hivemind", "byzantine", "byzantine_collude")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("comparison", nargs="+", choices=[*COMPARISONS, *STUDIES, "all", "gpu", "_bare"])
    parser.add_argument("--quick", action="store_true", help="tiny size for the tests (numbers mean nothing)")
    parser.add_argument("--size", choices=sorted(SIZES), default="",
                        help="default, eight (8 peers), long or quick (= --quick)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"ablation: comma-separated variants of {', '.join(VARIANTS)}")
    parser.add_argument("--no-baselines", dest="baselines", action="store_false",
                        help="ablation: the variants only, no DDP or sync runs (compare with another run's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="ablation, sweep, hivemind, byzantine: a config override for every run but sync DiLoCo's "
                             "outer lr and momentum (e.g. outer_lr=0.7), repeatable")
    parser.add_argument("--out", default="", help="output directory (default: a new temporary directory)")
    parser.add_argument("--repeat", type=int, default=1, help="run everything this many times (seeds 0, 1, ...)")
    parser.add_argument("--data", default="", help="corpus file (default: the bundled Shakespeare corpus)")
    parser.add_argument("--steps", type=int, default=0, help="override the size's inner steps per peer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parallel", type=int, default=0,
                        help="runs of one comparison at once (default: the size's; paced runs sleep most of the "
                             "time, so several at once keep their timing)")
    parser.add_argument("--overrides", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--preset", default=PRESET, help=argparse.SUPPRESS)
    parser.add_argument("--duration", type=float, default=0, help="gpu: seconds of training (default 180)")
    parser.add_argument("--rescore", action="store_true",
                        help="byzantine: recompute the figures of the runs in --out from their metrics, run nothing")
    parser.add_argument("--rules", default="mean,centered_clip", help=f"byzantine --attacks: under these rules "
                                                                      f"(of {', '.join(RULES)})")
    parser.add_argument("--attacks", default="", help="byzantine, byzantine_collude: only these attacks "
                                                      "(comma-separated; 'clean' for the honest swarm, 'control' "
                                                      "for the honest peers alone), each under --rules")
    args = parser.parse_args(argv)
    if args.comparison == ["_bare"]:
        bare_main(args.steps, args.seed, json.loads(args.overrides), args.preset)
        return 0
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    size = SIZES[args.size or ("quick" if args.quick else "default")]
    variants = tuple(v for v in args.variants.split(",") if v)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    extra = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set wants KEY=VALUE, got {item!r}")
        try:  # numbers and booleans as JSON, anything else as a string
            extra[key] = json.loads(value)
        except json.JSONDecodeError:
            extra[key] = value
    if args.steps:
        size = replace(size, steps=args.steps, byzantine_steps=args.steps)
    if args.duration:
        size = replace(size, duration=args.duration)
    if args.rescore:  # the byzantine studies' figures again, from the runs on disk
        results = json.loads((Path(args.out) / "results.json").read_text())
        rescore(results, Path(args.out))
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
        print(report(results, Path(args.out)))
        return 0
    if args.attacks:
        cells = tuple((a, rule) for a in args.attacks.split(",") for rule in args.rules.split(","))
        size = replace(size, byzantine_runs=cells, collusion_runs=cells)
    if args.parallel:
        size = replace(size, parallel=args.parallel)
    out = Path(args.out or tempfile.mkdtemp(prefix="p2pdiloco-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    names = COMPARISONS if "all" in args.comparison else tuple(dict.fromkeys(args.comparison))
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {"by_seed": {}}
    results.update(size=size.__dict__, machine=machine())
    failures = []
    signal.signal(signal.SIGTERM, _terminate)
    try:
        run_all(args, out, size, names, results, failures, variants=variants, extra=extra)
    except KeyboardInterrupt:  # SIGTERM or Ctrl-C: every run's peers are stopped by now
        print(f"bench: stopped; the results so far are in {results_path}", file=sys.stderr)
        return 1
    print(report(results, out))
    plots = plot(results, out)
    print(f"bench: results.json, results.md{''.join(', ' + p for p in plots)} in {out}")
    for failure in failures:
        print(f"bench: FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


def _terminate(signum, frame):
    """SIGTERM: the swarms that wait in worker threads (Bench.many) stop too (localswarm.STOPPING),
    and every run unwinds through the `with` or `finally` that stops its peers."""
    localswarm.STOPPING.set()
    raise KeyboardInterrupt


def run_all(args, out: Path, size, names, results: dict, failures: list, *, variants, extra) -> None:
    results_path = out / "results.json"
    for seed in range(args.seed, args.seed + args.repeat):
        bench = Bench(out, size, seed=seed, data=args.data, variants=variants, extra=extra, baselines=args.baselines)
        for name in names:
            t0 = time.monotonic()
            print(f"bench: {name} (seed {seed}) ...", flush=True)
            try:
                result = getattr(bench, name)()
            except Exception as e:  # one broken comparison must not cost the others: reported, exit 1
                result = {"error": f"{type(e).__name__}: {e}"[:2000]}
                failures.append(f"{name} (seed {seed}): {result['error'][:300]}")
            result["bench_s"] = time.monotonic() - t0
            results["by_seed"].setdefault(str(seed), {})[name] = result
            results_path.write_text(json.dumps(results, indent=1))
            print(f"bench: {name} (seed {seed}) done in {result['bench_s']:.0f}s", flush=True)


def machine() -> dict:
    import os
    import platform

    import torch

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform()}


if __name__ == "__main__":
    sys.exit(main())
