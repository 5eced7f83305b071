#!/usr/bin/env python3
"""Real sizes on this machine: what a peer of the 85M preset costs, how joins go, how a swarm grows.

    python scripts/scale.py peers --size real --duration 120 --out runs/scale     # 85M, CPU: memory, rounds
    python scripts/scale.py join --size real --sources 3                          # 85M joins from 3 sources
    python scripts/scale.py join --size medium --sources 4 --rate-mbit 50         # ... behind 50 Mbit/s (netns)
    python scripts/scale.py join --size small --rate-mbit 20 --leave --stop       # a source dies; a SIGTERM
    python scripts/scale.py join --size small --sources 2 --data DIR --manifest-only   # shards from peers too
    python scripts/scale.py swarm --sizes 2 4 8 16 --plot docs/img/scale-swarm.png
    python scripts/scale.py peers --size tiny --duration 10                       # the suite's sizes

`peers`: founders a and b (the 85M `small-gpu` preset on the CPU as a new user would try it:
batch 1, H=3, so that rounds come every ~20 s), then joiner c once they have averaged, from
both. Every 2 s it samples each process of each peer (trainer, averager, DHT, p2pd) as PSS, so
that pages shared after a fork or through shared memory are not counted twice. Prints the
round time and bytes of the founders, the joiner's download, and per process and per peer the
peak and the steady (median after the join) PSS, against issue 11's target: 16 bytes per
parameter beyond the model, its gradients and AdamW's state (16 more), plus 1.5 GB fixed.

`join`: sources that share state (and never average), then joiners one after the other: seconds,
MB/s, sources used; with --rate-mbit each source sits in a network namespace behind that limit.
With --data DIR (prepared by `p2pdiloco prepare`) and --manifest-only, each joiner holds only the
manifest: it fetches the held-out shards and the train shards it claims from the sources (data/
fetch.py), and the shard fetches' MB/s are printed beside the state download's (issue 19: >= 0.8).

`swarm`: 2..16 tiny peers paced by --slowdown: group sizes, rounds per minute, round time, DHT
bytes per peer per round, as the swarm grows.

Real `p2pdiloco join` processes; every process (and namespace) is reaped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from procmem import Every, peer_roles, sample  # noqa: E402

from p2pdiloco import grid  # noqa: E402
from p2pdiloco.config import Config  # noqa: E402
from p2pdiloco.data.manifest import copy_manifest  # noqa: E402
from p2pdiloco.localswarm import LocalSwarm  # noqa: E402
from p2pdiloco.metrics import read_metrics  # noqa: E402
from p2pdiloco.model import build_model, num_params  # noqa: E402

SIZES = {
    # the 85M preset on this machine's CPU: a round every ~20 s (same flags as join_bench.py)
    "real": (str(ROOT / "peers" / "small-gpu.toml"),
             ["--device", "cpu", "--batch-size", "1", "--inner-steps", "3", "--threads", "1", "--eval-batches", "1",
              "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--state-timeout", "300"]),
    "tiny": (str(ROOT / "peers" / "tiny-cpu.toml"), ["--inner-steps", "30", "--state-timeout", "20"]),
    # the 85M preset with 4 of its 12 layers (28.9M parameters, a 231 MB state): 5 of them fit beside
    # each other in namespaces, and a download over 50 Mbit/s links still takes seconds
    "medium": (str(ROOT / "peers" / "small-gpu.toml"),
               ["--device", "cpu", "--batch-size", "1", "--threads", "1", "--eval-batches", "1", "--n-layer", "4",
                "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--state-timeout", "300"]),
    # 1 of its 12 layers (7.7M parameters, a 62 MB state): the suite's netns join, seconds at 20 Mbit/s
    "small": (str(ROOT / "peers" / "small-gpu.toml"),
              ["--device", "cpu", "--batch-size", "1", "--threads", "1", "--eval-batches", "1", "--n-layer", "1",
               "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--state-timeout", "120"]),
}
LAYERS = {"medium": 4, "small": 1}
# join: sources never average (their state stays the shared init), and mostly sleep (--slowdown)
SOURCE_FLAGS = ["--inner-steps", "1000000", "--slowdown", "20", "--log-interval", "2"]
ROLES = ("trainer", "averager", "dht", "p2pd")
TARGET_BYTES_PER_PARAM = 16 + 16  # model, grads, AdamW (16) + at most 16 more
TARGET_FIXED_MB = 1500.0


def model_params(preset: str, overrides: Optional[dict] = None) -> int:
    cfg = Config.from_sources(preset, overrides or {})
    with torch.device("meta"):
        return num_params(build_model(cfg))


def sample_peers(swarm: LocalSwarm, samples: list) -> None:
    """One sample of the memory of every live peer's processes: {"time", "peer", role: {...}}."""
    now = time.time()
    for name, peer in list(swarm.peers.items()):
        if peer.proc.poll() is None:
            samples.append({"time": now, "peer": name, **sample(peer_roles(peer.pgid))})


def memory_table(samples: list[dict], since: dict[str, float]) -> dict:
    """Per peer and role: peak PSS over the run, steady PSS (median of the samples after `since`)."""
    out = {}
    for name in sorted({s["peer"] for s in samples}):
        mine = [s for s in samples if s["peer"] == name]
        row = {}
        for role in (*ROLES, "total"):
            values = [(s["time"], sum(s[r]["pss_mb"] for r in ROLES if r in s) if role == "total"
                       else s[role]["pss_mb"]) for s in mine if role == "total" or role in s]
            late = [v for t, v in values if t >= since.get(name, 0.0)]
            row[role] = {"peak_mb": max((v for _, v in values), default=None),
                         "steady_mb": statistics.median(late) if late else None}
        row["rss_peak_mb"] = {r: max((s[r]["rss_mb"] for s in mine if r in s), default=None) for r in ROLES}
        out[name] = row
    return out


def peak_times(samples: list[dict], merges: dict[str, list[float]]) -> dict:
    """When each peer's total PSS peaked, and how far (s) that was from its nearest merge round's end."""
    out = {}
    for name in sorted({s["peer"] for s in samples}):
        peak = max((s for s in samples if s["peer"] == name),
                   key=lambda s: sum(s[r]["pss_mb"] for r in ROLES if r in s))
        near = min((abs(peak["time"] - t) for t in merges.get(name, [])), default=None)
        out[name] = {"time": peak["time"], "from_merge_s": near}
    return out


def run_peers(size: str, duration: float, workdir: Path, data: str = "", away: float = 0.0) -> dict:
    """away > 0: after the joiner's first round, SIGSTOP its whole process group for `away` s (a laptop
    that sleeps) and SIGCONT it: the founders step on without it, so its next round with them is a merge
    round, the memory's worst case (the 8 B/param of merge segments are resident then)."""
    preset, flags = SIZES[size]
    if data:
        flags = [*flags, "--data", data]
    numel = model_params(preset, {"data": data} if data else {})
    round_bound = 180.0 if size == "real" else 30.0
    samples: list[dict] = []
    with LocalSwarm(workdir, config=preset, extra_args=flags) as swarm, \
            Every(lambda: sample_peers(swarm, samples), 2.0):
        t0 = time.time()
        swarm.start("a")
        swarm.start("b", join="a")
        swarm.wait_for(lambda: all(swarm.events(n, "outer") for n in "ab"), timeout=4 * round_bound,
                       what="the founders' first round")
        t_founded = time.time()
        swarm.start("c", join=["a", "b"])
        swarm.wait_for(lambda: swarm.events("c", "join"), timeout=4 * round_bound, what="the joiner's download")
        joined = swarm.events("c", "join")[0]
        stopped = None
        if away:
            swarm.wait_for(lambda: swarm.events("c", "outer"), timeout=4 * round_bound, what="the joiner's first round")
            stopped = time.time()
            swarm.signal("c", signal.SIGSTOP)
            try:
                time.sleep(away)
            finally:
                swarm.signal("c", signal.SIGCONT)
            swarm.wait_for(lambda: any(r.get("merged") and r["time"] > stopped for r in swarm.events("c", "outer")),
                           timeout=4 * round_bound, what="the merge round that takes the sleeper back")
        end = max(joined["time"] + duration, time.time() + 10.0)
        swarm.wait_for(lambda: time.time() > end, timeout=end - time.time() + 60, what="the run's end")
        exit_codes = swarm.stop_all(timeout=30.0)
        rounds = [r for n in "ab" for r in swarm.events(n, "outer")]
        resyncs = [r for n in "abc" for r in swarm.events(n, "resync")]
        c_rounds = [r for r in swarm.events("c", "outer")]
        merges = {n: [r["time"] for r in swarm.events(n, "outer") if r.get("merged")] for n in "abc"}
    round_s = sorted(r["round_s"] for r in rounds)
    # the joiner settles 10 s after its download (less in a short run, which must still see steady samples)
    steady_since = {"a": t_founded, "b": t_founded, "c": joined["time"] + min(10.0, duration / 2)}
    memory = memory_table(samples, steady_since)
    target_mb = (TARGET_BYTES_PER_PARAM * numel) / 1e6 + TARGET_FIXED_MB
    return {
        "size": size, "params": numel, "duration_s": duration, "founding_s": t_founded - t0, "started": t0,
        "join_download_s": joined.get("download_s"), "join_outer_step": joined.get("loaded_outer_step"),
        "state_mb": numel * 8 / 1e6,
        "founder_rounds": len(rounds), "joiner_rounds": len(c_rounds), "resyncs": len(resyncs),
        "round_s_median": statistics.median(round_s) if round_s else None,
        "round_s_p90": round_s[int(0.9 * (len(round_s) - 1))] if round_s else None,
        "round_bytes_sent_mb": statistics.median(r["bytes_sent"] for r in rounds) / 1e6 if rounds else None,
        "round_bytes_recv_mb": statistics.median(r["bytes_recv"] for r in rounds) / 1e6 if rounds else None,
        "memory": memory, "target_mb_per_peer": target_mb, "away_s": away, "away_from": stopped,
        "merge_rounds": {n: len(t) for n, t in merges.items()}, "merge_times": merges,
        "peak_at": peak_times(samples, merges),
        "bytes_per_param_beyond_16": {n: (m["total"]["peak_mb"] * 1e6 - 16 * numel) / numel
                                      for n, m in memory.items() if m["total"]["peak_mb"]},
        "exit_codes": exit_codes, "samples": samples,
    }


def run_join(size: str, sources: int, repeats: int, workdir: Path, *, rate_mbit: float = 0.0,
             data: str = "", leave: bool = False, stop: bool = False, manifest_only: bool = False) -> dict:
    """`sources` peers share state; a joiner (then another, `repeats` times) downloads it and stops.
    rate_mbit: every source in its own network namespace behind that limit (both directions),
    the joiner's link unlimited: the sources' uplinks are the bottleneck, as the issue frames it.
    leave: 1 s into each download, the last live source is SIGKILLed (the joiner must finish from
    the others, with no traceback). stop: one more joiner gets SIGTERM 1 s into its download; its
    exit time is measured (issue 11: within 10 s)."""
    preset, flags = SIZES[size]
    if data:
        flags = [*flags, "--data", data]
    numel = model_params(preset, overrides={**({"n_layer": LAYERS[size]} if size in LAYERS else {}),
                                            **({"data": data} if data else {})})  # the data sets the vocabulary
    with contextlib.ExitStack() as stack:
        net = None
        if rate_mbit:
            from netns import Namespaces  # root and `ip netns`: only for this mode
            net = stack.enter_context(Namespaces(sources + 1, rates=[rate_mbit] * sources + [None], tag="join"))
        swarm = stack.enter_context(LocalSwarm(workdir, config=preset, extra_args=[]))

        def start(i: int, name: str, *extra: str, join=None) -> None:
            args = list(flags)
            wrapper: list = []
            if net is not None:
                args = [f"/ip4/{net.addr(i)}/tcp/0" if a.startswith("/ip4/127.0.0.1") else a for a in args]
                wrapper = net.prefix(i)
            cmd = [*wrapper, sys.executable, "-m", "p2pdiloco", "join", "--config", preset, "--log-dir",
                   str(workdir / name), "--maddrs-file", str(workdir / f"{name}.maddrs"), *args, *extra]
            if join:
                cmd += ["--initial-peers", *[swarm.maddr(n, timeout=120) for n in join]]
            swarm.spawn(name, cmd)

        names = [f"s{i}" for i in range(sources)]
        start(0, names[0], *SOURCE_FLAGS)
        for i, name in enumerate(names[1:], start=1):
            start(i, name, *SOURCE_FLAGS, join=names[:1])
        swarm.wait_for(lambda: all(swarm.events(n, "inner") for n in names), timeout=600, what="every source trains")
        joins, live = [], list(names)

        def downloading(name: str) -> None:
            swarm.wait_for(lambda: "downloading the swarm's state" in swarm.stderr(name, tail=1 << 30)
                           or swarm.peers[name].proc.poll() is not None, timeout=300, what=f"{name} downloads")
            time.sleep(1.0)

        for r in range(repeats):
            name = f"j{r}"
            own = copy_manifest(data, workdir / f"{name}-data") if manifest_only else None
            start(sources, name, "--max-inner-steps", "1", *(["--data", str(own), "--shard-cache",
                                                              str(workdir / f"{name}-cache")] if own else []),
                  join=live)
            left = None
            if leave and len(live) > 1:
                downloading(name)
                left = live.pop()
                swarm.signal(left, signal.SIGKILL)
            swarm.wait_for(lambda: swarm.events(name, "join") or swarm.peers[name].proc.poll() is not None,
                           timeout=600, what=f"{name}'s download")
            event = (swarm.events(name, "join") or [{}])[0]
            code = swarm.wait_exit(name, timeout=120)
            joins.append({"download_s": event.get("download_s"), "sources": event.get("sources"),
                          "source_killed": left, "exit_code": code,
                          "traceback": "Traceback" in swarm.stderr(name, tail=1 << 30),
                          "fetches": [{"shard": f["shard"], "mb": sum(f["bytes"].values()) / 1e6,
                                       "seconds": f["seconds"], "sources": len(f["bytes"])}
                                      for f in swarm.events(name, "fetch") if f.get("ok")]})
        stopped = None
        if stop:
            start(sources, "stopped", join=live)
            downloading("stopped")
            t_signal = time.monotonic()
            swarm.signal("stopped", signal.SIGTERM, whole_group=False)
            code = swarm.wait_exit("stopped", timeout=60)
            stopped = {"exit_s": time.monotonic() - t_signal, "exit_code": code,
                       "joined_first": bool(swarm.events("stopped", "join")),
                       "traceback": "Traceback" in swarm.stderr("stopped", tail=1 << 30)}
        exit_codes = swarm.stop_all(timeout=30.0)
    state_mb = numel * 8 / 1e6
    link_s = state_mb * 8 / rate_mbit / sources if rate_mbit else None
    for j in joins:
        j["mb_per_s"] = state_mb / j["download_s"] if j["download_s"] else None
        j["x_link"] = j["download_s"] / link_s if link_s and j["download_s"] else None
        train = [f for f in j["fetches"] if f["shard"].startswith("train")]
        mb, seconds = sum(f["mb"] for f in train), sum(f["seconds"] for f in train)
        j["fetch_mb_per_s"] = mb / seconds if seconds else None
        j["fetch_vs_state"] = j["fetch_mb_per_s"] / j["mb_per_s"] if j["fetch_mb_per_s"] and j["mb_per_s"] else None
    return {"size": size, "params": numel, "state_mb": state_mb, "sources": sources, "rate_mbit": rate_mbit,
            "link_s": link_s, "joins": joins, "stopped": stopped, "exit_codes": exit_codes}


def _io_bytes(pid: int) -> int:
    """Bytes the process read and wrote through syscalls (sockets and pipes included)."""
    try:
        fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        return int(fields["rchar"]) + int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return 0


def run_swarm(size: int, duration: float, workdir: Path, *, slowdown: float, data: str = "",
              target_group: int = 0, use_grid: bool = True, legacy_dht: str = "", total_steps: int = 0,
              steps: int = 0, clock_step: Optional[tuple[float, float]] = None, dht_breakdown: bool = False,
              inner_steps: int = 0, aggregation: str = "", rate_mbit: float = 0.0,
              peer_args: tuple = ()) -> dict:
    """`size` tiny peers start together through a bootstrap node, paced by --slowdown so that 16 fit
    on 2 cores, and train for `duration` s; with `rate_mbit` each peer in its own network namespace
    behind that limit (both directions; the bootstrap node unlimited), so that bandwidth sets the ratio;
    `peer_args` go last on every peer's command line (the preset's timeouts are sized for loopback).
    Per peer: group sizes, the share of rounds that held every live peer (or, with a grid, a whole line
    of it), inner steps per contribution, applied rounds per minute, round time, failed rounds, the
    spread of the anchors of all live peers, and the bytes its DHT process moved (through its p2pd
    socket and its pipes to the trainer and averager) per applied round and per minute."""
    preset, flags = SIZES["tiny"]
    target = target_group or int(Config.from_sources(preset).target_group_size)
    flags = [*flags, "--slowdown", str(slowdown), "--wait-for-peers", str(size), "--max-time", str(duration),
             "--run-id", f"scale-swarm-{size}", "--bootstrap-timeout", "120", "--target-group-size", str(target),
             "--grid" if use_grid else "--no-grid", *(["--total-steps", str(total_steps)] if total_steps else []),
             *(["--max-inner-steps", str(steps)] if steps else []),
             *(["--inner-steps", str(inner_steps)] if inner_steps else []),
             *(["--aggregation", aggregation] if aggregation else []), *peer_args]
    if data:
        flags = [*flags, "--data", data]
    names = [f"p{i:02d}" for i in range(size)]
    env = {"P2PDILOCO_LEGACY_DHT": legacy_dht} if legacy_dht else {}
    step_file = workdir / "clock-step"  # its appearance steps every peer's wall clock (cli._test_clock_step)
    step_file.unlink(missing_ok=True)
    if clock_step:
        env["P2PDILOCO_TEST_CLOCK_STEP"] = f"{step_file}:{clock_step[1]}"
    counts = workdir / "dhtcount"  # scripts/dhtcount/sitecustomize.py writes there
    if dht_breakdown:
        shutil.rmtree(counts, ignore_errors=True)
        counts.mkdir(parents=True)
        env["DHTCOUNT_DIR"] = str(counts)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "scripts" / "dhtcount"),
                                                          os.environ.get("PYTHONPATH", "")]))
    with contextlib.ExitStack() as stack:
        net = None
        if rate_mbit:
            from netns import Namespaces  # root and `ip netns`: only with a rate
            net = stack.enter_context(Namespaces(size + 1, rates=[None] + [rate_mbit] * size, tag="swarm"))
        swarm = stack.enter_context(LocalSwarm(workdir, config=preset, extra_args=flags, env=env))
        swarm.start_bootstrap(host=net.addr(0) if net else "127.0.0.1", wrapper=net.prefix(0) if net else ())
        boot = swarm.maddr("boot")
        for i, name in enumerate(names, start=1):
            where = [*net.prefix(i)] if net else []
            host = ["--host-maddrs", f"/ip4/{net.addr(i)}/tcp/0"] if net else []
            swarm.spawn(name, [*where, sys.executable, "-m", "p2pdiloco", "join", "--config", preset, "--log-dir",
                               str(workdir / name), "--maddrs-file", str(workdir / f"{name}.maddrs"), *flags, *host,
                               "--initial-peers", boot])
        t0, launched = time.time(), time.monotonic()
        swarm.wait_for(lambda: all(swarm.events(n, "inner") for n in names), timeout=240 + 10 * size,
                       what="every peer trains")
        t_trained = time.time()
        first: dict[str, tuple] = {}  # peer -> (DHT process I/O bytes, applied rounds), first and last seen
        last: dict[str, tuple] = {}
        deadline = time.monotonic() + duration + 180
        while time.monotonic() < deadline and any(swarm.peers[n].proc.poll() is None for n in names):
            for name in names:
                pid = peer_roles(swarm.peers[name].pgid).get("dht")
                if pid and swarm.peers[name].proc.poll() is None:
                    seen = (_io_bytes(pid), len(swarm.events(name, "outer")), time.monotonic())
                    first.setdefault(name, seen)
                    last[name] = seen
            if clock_step and not step_file.exists() and time.monotonic() >= launched + clock_step[0]:
                step_file.touch()
            time.sleep(1.0 if clock_step and not step_file.exists() else 5.0)
        exit_codes = swarm.stop_all(timeout=30.0)
        outer = {n: swarm.events(n, "outer") for n in names}
        failed = {n: swarm.events(n, "round_failed") for n in names}
        finals = {n: (swarm.events(n, "final") or [{}])[0] for n in names}
        # every one a false ban: no peer of these runs attacks (docs/scale.md, "at a small H the robust rule bans")
        bans = sum(len(swarm.events(n, "banned")) for n in names)
    dht = [(last[n][0] - first[n][0]) / (last[n][1] - first[n][1]) for n in names
           if n in last and last[n][1] > first[n][1]]
    dht_min = [(last[n][0] - first[n][0]) / ((last[n][2] - first[n][2]) / 60) for n in names
               if n in last and last[n][2] > first[n][2]]
    return {"peers": size, "slowdown": slowdown, "duration_s": duration, "start_s": t_trained - t0,
            "rate_mbit": rate_mbit, "peer_args": list(peer_args),
            "target_group_size": target, "grid": use_grid, "inner_steps": inner_steps or _preset_inner_steps(),
            "legacy_dht": legacy_dht, "steps": steps, "aggregation": aggregation or "the preset's",
            "clock_step": clock_step, "bans": bans,
            **({"dht_breakdown": dht_bytes_by_key(counts)} if dht_breakdown else {}),
            **swarm_stats(outer, failed, finals, size=size, target=target, duration=duration,
                          inner_steps=inner_steps or _preset_inner_steps()),
            "dht_kb_per_peer_round": statistics.median(dht) / 1e3 if dht else None,
            "dht_kb_per_peer_min": statistics.median(dht_min) / 1e3 if dht_min else None, "exit_codes": exit_codes}


def dht_bytes_by_key(counts: Path) -> dict:
    """What the DHT nodes of a run served (scripts/dhtcount/sitecustomize.py): bytes of RPC payload
    (request + response protobufs, each RPC counted once, where it was served) by RPC and by kind of
    key, over the whole run, start-up included."""
    names, served, calls = {}, {}, {}
    for path in counts.glob("*.json"):
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError):  # a process killed mid-write leaves only its .tmp
            continue
        names.update({key_id: name for name, key_id in found["names"].items()})
        for key, n in found["bytes"].items():
            served[key] = served.get(key, 0.0) + n
        for rpc, n in found["calls"].items():
            calls[rpc] = calls.get(rpc, 0) + n
    kinds = (("_progress", "progress records"), ("_status", "status records"), ("_verdict_", "verdicts"),
             ("_check_", "reducer checks"),
             (".all_averagers", "state sharing"), (".0b", "matchmaking (group keys)"), ("_members", "run membership"),
             ("_configs", "run config"), ("p2pdiloco_peers", "run config"))
    by_kind: dict[str, float] = {}
    for key, n in served.items():
        rpc, key_id = key.split("|")
        name = names.get(key_id)
        kind = ("routing (no key)" if key_id == "-" else "unknown" if name is None
                else next((k for tag, k in kinds if tag in name), "other"))
        row = f"{rpc.removeprefix('rpc_')} {kind}"
        by_kind[row] = by_kind.get(row, 0.0) + n
    return {"bytes": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])), "calls": calls}


SETTLED_S = 60.0  # rounds this long after the swarm's first one count as settled (no schedule before it)


def _preset_inner_steps() -> int:
    """H of the swarm's tiny peers unless --inner-steps sets it."""
    flags = SIZES["tiny"][1]
    return int(flags[flags.index("--inner-steps") + 1])


def line_whole_share(outer: list[dict], *, size: int, target: int) -> Optional[float]:
    """The share of applied rounds (outer events with `grid` = [round, dims, cell]) whose group held every
    live peer of its line, counting a line's used cells (index < size) on the grid of grid.sides (grid.line_size)
    (with one dimension: min(size, target), the group a swarm without a grid forms)."""
    whole = counted = 0
    for r in outer:
        if not r.get("grid"):
            continue
        round_, dims, cell = r["grid"]
        need = min(size, target)  # one dimension: one group of up to the target
        if dims > 1:
            need = grid.line_size(cell, round_=round_, dims=dims, size=target, live=size)
        counted += 1
        whole += r["group_size"] >= max(1, need)
    return whole / counted if counted else None


def swarm_stats(outer: dict, failed: dict, finals: dict, *, size: int, target: int, duration: float,
                inner_steps: int) -> dict:
    """What the peers' metrics files say of a swarm run (peer -> its outer / round_failed events and
    its final event): groups, rounds, contributions, the anchors' spread, final eval losses."""
    preset, _ = SIZES["tiny"]
    base = Config.from_sources(preset)
    tokens_per_step = base.batch_size * base.block_size
    names = list(outer)
    groups = [r["group_size"] for rs in outer.values() for r in rs]
    round_s = sorted(r["round_s"] for rs in outer.values() for r in rs)
    wall = statistics.median(f.get("wall_s", duration) for f in finals.values())
    per_min = [len(outer[n]) / (wall / 60) for n in names]
    # each peer's own inner steps per second of training: the input simulate.py --compare takes
    rates = [f["inner_step"] / f["wall_s"] for f in finals.values()
             if isinstance(f.get("inner_step"), (int, float)) and isinstance(f.get("wall_s"), (int, float))
             and f["wall_s"] > 0]
    steps = sorted(r["tokens"] / tokens_per_step for rs in outer.values() for r in rs if r.get("tokens"))
    # a group that holds every live peer, or with a grid (more peers than the target) a whole line of it
    line = size if size <= target else max(grid.sides(size, grid.dims_for(size, target), target))
    evals = [f["eval_loss"] for f in finals.values() if isinstance(f.get("eval_loss"), (int, float))]
    spread = anchor_spread(outer, every=5.0)
    t_first = min((r["time"] for rs in outer.values() for r in rs), default=0.0)
    settled = [r["group_size"] for rs in outer.values() for r in rs if r["time"] >= t_first + SETTLED_S]
    t_last = max((r["time"] for rs in outer.values() for r in rs), default=0.0)
    late = [r["group_size"] for rs in outer.values() for r in rs if r["time"] >= (t_first + t_last) / 2]
    entries = sum(len(o) for o in outer.values()) + sum(len(f) for f in failed.values())
    alone = sum("no group" in r.get("reason", "") for fs in failed.values() for r in fs)
    period = inner_steps / statistics.median(rates) if rates else None
    spreads = entry_spreads([r["entered"] for rs in (*outer.values(), *failed.values()) for r in rs
                             if isinstance(r.get("entered"), (int, float))], gap=period / 2 if period else 1.0)
    return {
        # a contribution's time (H steps at the median peer's rate) over a round's: the ratio issue 36 sweeps
        "ratio": period / statistics.median(round_s) if period and round_s else None,
        # how far apart the peers entered matchmaking for one round (max - min, seconds)
        "entry_spread_median": statistics.median(spreads) if spreads else None,
        "entry_spread_p90": spreads[int(0.9 * (len(spreads) - 1))] if spreads else None,
        "final_eval_mean": statistics.mean(evals) if evals else None,
        "final_eval_min": min(evals, default=None), "final_eval_max": max(evals, default=None),
        "full_share": sum(g >= line for g in groups) / len(groups) if groups else None,
        "full_share_settled": sum(g >= line for g in settled) / len(settled) if settled else None,
        # the same over the second half of the rounds' span: a short run's settled share
        "full_share_second_half": sum(g >= line for g in late) / len(late) if late else None,
        # with a grid: the groups that held every used cell of their line (cells 0..N-1 of the grid of grid.sides),
        # from each round's [round, dims, cell]; a grid of more cells than N has short lines too
        "line_whole_share": line_whole_share([r for rs in outer.values() for r in rs], size=size, target=target),
        "alone_share": alone / entries if entries else None,
        "steps_median": statistics.median(steps) if steps else None,
        "steps_max": steps[-1] if steps else None,  # a stalled schedule: contributions of many times H
        "steps_within_10pct": (sum(abs(x - inner_steps) <= 0.1 * inner_steps for x in steps) / len(steps)
                               if steps else None),
        "spread_median": statistics.median(v for _, v in spread) if spread else None,
        "spread_first_half": _half(spread, 0), "spread_second_half": _half(spread, 1),
        "spread_series": spread,
        # distinct peers each peer averaged with (a grid mixes: more than one line's worth)
        "partners_min": min((len({m for r in outer[n] for m in r.get("members") or []} - {n_id(outer[n])})
                             for n in names), default=0),
        "group_size_mean": statistics.mean(groups) if groups else None,
        "group_size_median": statistics.median(groups) if groups else None,
        "group_size_max": max(groups, default=None),
        "rounds_per_min_median": statistics.median(per_min), "rounds_per_min_min": min(per_min),
        "steps_per_s_median": statistics.median(rates) if rates else None,
        "round_s_median": statistics.median(round_s) if round_s else None,
        "round_s_p90": round_s[int(0.9 * (len(round_s) - 1))] if round_s else None,
        "failed_rounds": sum(len(f) for f in failed.values()),
        "applied_rounds": sum(len(o) for o in outer.values()),
    }


def entry_spreads(entered: list[float], *, gap: float) -> list[float]:
    """The peers' entries into matchmaking (wall-clock times), cut into rounds wherever two
    consecutive entries lie more than `gap` s apart: each round's spread (last - first), sorted."""
    spreads, first, last = [], None, None
    for t in sorted(entered):
        if first is not None and t - last > gap:
            spreads.append(last - first)
            first = None
        first = t if first is None else first
        last = t
    if first is not None:
        spreads.append(last - first)
    return sorted(spreads)


def rescore_swarm(out: Path) -> list[dict]:
    """The stats of the swarm runs in `out` again, from the peers' metrics files (the DHT bytes, read
    from /proc while the runs ran, are kept from result.json)."""
    results = json.loads((out / "result.json").read_text())
    for r in results:
        workdir = out / f"swarm-{r['peers']}"
        runs = {p.name: read_metrics(p / "metrics.jsonl") for p in sorted(workdir.glob("p*")) if p.is_dir()}
        outer = {n: [e for e in rs if e["event"] == "outer"] for n, rs in runs.items()}
        failed = {n: [e for e in rs if e["event"] == "round_failed"] for n, rs in runs.items()}
        finals = {n: ([e for e in rs if e["event"] == "final"] or [{}])[0] for n, rs in runs.items()}
        r.update(swarm_stats(outer, failed, finals, size=r["peers"],
                             inner_steps=r.get("inner_steps") or _preset_inner_steps(),
                             target=r.get("target_group_size") or max(8, r["peers"]), duration=r["duration_s"]))
    return results


def anchor_spread(outer: dict[str, list[dict]], every: float) -> list[tuple[float, float]]:
    """(seconds since the first round, spread) every `every` s: each live peer's latest anchor digest
    (256 anchor values at positions every peer shares, logged with each applied round), and the mean
    relative distance of those digests to their mean, across all peers, not only within a round."""
    rounds = sorted((r["time"], peer, r["digest"]) for peer, rs in outer.items() for r in rs if r.get("digest"))
    if not rounds:
        return []
    t0, t_end = rounds[0][0], rounds[-1][0]
    out, latest, i = [], {}, 0
    t = t0 + every
    while t <= t_end:
        while i < len(rounds) and rounds[i][0] <= t:
            latest[rounds[i][1]] = torch.tensor(rounds[i][2])
            i += 1
        if len(latest) >= 2:
            stack = torch.stack(list(latest.values()))
            mean = stack.mean(0)
            out.append((round(t - t0, 1), float((stack - mean).norm(dim=1).mean() / mean.norm().clamp_min(1e-12))))
        t += every
    return out


def n_id(rounds: list[dict]) -> str:
    """The short peer id (as the outer event's members list it) of the peer that logged these rounds."""
    return str(rounds[0].get("peer", ""))[-6:] if rounds else ""


def _half(series: list[tuple[float, float]], which: int) -> Optional[float]:
    half = len(series) // 2
    part = series[:half] if which == 0 else series[half:]
    return statistics.median(v for _, v in part) if part else None


def print_swarm(results: list[dict]) -> None:
    print(f"{'peers':>5} {'group':>5} {'grid':>4} {'group mean':>10} {'max':>4} {'full':>5} {'settled':>7} "
          f"{'alone':>5} {'H +-10%':>7} {'max steps':>9} "
          f"{'rounds/min':>10} {'min':>5} {'round s':>8} {'p90':>6} {'failed':>6} {'applied':>7} "
          f"{'spread':>8} {'1st half':>8} {'2nd half':>8} {'eval':>6} {'DHT kB/peer/round':>18} {'/min':>7} "
          f"{'start s':>8} {'ratio':>6} {'entry spread':>12} {'p90':>6} {'bans':>4} {'whole lines':>11}")
    for r in results:
        print(f"{r['peers']:>5} {r.get('target_group_size', '-'):>5} {'yes' if r.get('grid') else 'no':>4} "
              f"{_num(r['group_size_mean'], 1):>10} {_num(r['group_size_max'], 0):>4} "
              f"{_num(r.get('full_share'), 2):>5} {_num(r.get('full_share_settled'), 2):>7} "
              f"{_num(r.get('alone_share'), 2):>5} {_num(r.get('steps_within_10pct'), 2):>7} "
              f"{_num(r.get('steps_max'), 0):>9} "
              f"{r['rounds_per_min_median']:>10.1f} {r['rounds_per_min_min']:>5.1f} {_num(r['round_s_median'], 2):>8} "
              f"{_num(r['round_s_p90'], 2):>6} {r['failed_rounds']:>6} {r['applied_rounds']:>7} "
              f"{_num(r.get('spread_median'), 5):>8} {_num(r.get('spread_first_half'), 5):>8} "
              f"{_num(r.get('spread_second_half'), 5):>8} {_num(r.get('final_eval_mean'), 3):>6} "
              f"{_num(r['dht_kb_per_peer_round'], 1):>18} {_num(r.get('dht_kb_per_peer_min'), 0):>7} "
              f"{r['start_s']:>8.0f} {_num(r.get('ratio'), 1):>6} {_num(r.get('entry_spread_median'), 2):>12} "
              f"{_num(r.get('entry_spread_p90'), 2):>6} {_num(r.get('bans'), 0):>4} "
              f"{_num(r.get('line_whole_share'), 2):>11}")


def print_dht_breakdown(results: list[dict]) -> None:
    """kB of DHT RPC payload served per applied peer-round, by RPC and kind of key, one column a run."""
    rows = list(dict.fromkeys(k for r in results for k in r["dht_breakdown"]["bytes"]))
    print(f"{'DHT RPC kB per peer-round':<40}" + "".join(f"{str(r['peers']) + ' peers':>12}" for r in results))
    for row in [*rows, "all"]:
        cells = []
        for r in results:
            served = r["dht_breakdown"]["bytes"]
            n = sum(served.values()) if row == "all" else served.get(row, 0.0)
            cells.append(f"{n / max(1, r['applied_rounds']) / 1e3:>12.1f}")
        print(f"{row:<40}" + "".join(cells))


def plot_swarm(results: list[dict], path: Path) -> None:
    from p2pdiloco.plot import pyplot

    plt = pyplot()
    n = [r["peers"] for r in results]
    panels = [("group size (mean)", "group_size_mean"), ("applied rounds / min / peer", "rounds_per_min_median"),
              ("round time, median (s)", "round_s_median"), ("DHT kB per peer per round", "dht_kb_per_peer_round")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, key) in zip(axes, panels):
        ax.plot(n, [r[key] if r[key] is not None else float("nan") for r in results], "o-")
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(v) for v in n])
        ax.set_xlabel("peers")
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_join(result: dict) -> None:
    where = f"{result['rate_mbit']:g} Mbit/s per source (netns)" if result["rate_mbit"] else "loopback"
    print(f"{result['size']}: {result['params']:,} parameters, state {result['state_mb']:.0f} MB, "
          f"{result['sources']} sources, {where}")
    if result["link_s"]:
        print(f"the links alone: {result['link_s']:.2f} s (state / rate / sources)")
    for i, j in enumerate(result["joins"]):
        took = "-" if j["download_s"] is None else f"{j['download_s']:.2f} s"
        rate = "" if not j["mb_per_s"] else f", {j['mb_per_s']:.0f} MB/s"
        vs = "" if not j["x_link"] else f", {j['x_link']:.2f}x the links"
        killed = f" ({j['source_killed']} SIGKILLed 1 s in)" if j["source_killed"] else ""
        print(f"join {i}: {took} from {j['sources']} source(s){killed}{rate}{vs}; exit {j['exit_code']}"
              f"{'; TRACEBACK in its log' if j['traceback'] else ''}")
        for f in j["fetches"]:
            print(f"  fetched {f['shard']}: {f['mb']:.1f} MB in {f['seconds']:.2f} s from {f['sources']} "
                  f"source(s), {f['mb'] / max(f['seconds'], 1e-9):.0f} MB/s")
        if j["fetch_mb_per_s"]:
            vs_state = f", {j['fetch_vs_state']:.2f}x the state download's" if j["fetch_vs_state"] else ""
            print(f"  train shards: {j['fetch_mb_per_s']:.0f} MB/s{vs_state}")
    if result["stopped"]:
        st = result["stopped"]
        print(f"SIGTERM 1 s into a download: exited {st['exit_s']:.1f} s later with code {st['exit_code']}"
              f"{' (its download had finished)' if st['joined_first'] else ''}"
              f"{'; TRACEBACK in its log' if st['traceback'] else ''}")


def print_peers(result: dict) -> None:
    print(f"{result['size']}: {result['params']:,} parameters; state {result['state_mb']:.0f} MB; "
          f"founders averaged after {result['founding_s']:.0f} s")
    print(f"founders: {result['founder_rounds']} rounds, round time median {result['round_s_median']:.1f} s, "
          f"p90 {result['round_s_p90']:.1f} s; {result['round_bytes_sent_mb']:.1f} MB sent, "
          f"{result['round_bytes_recv_mb']:.1f} MB received per round")
    print(f"joiner: downloaded outer step {result['join_outer_step']} in {result['join_download_s']:.2f} s; "
          f"{result['joiner_rounds']} rounds applied after; {result['resyncs']} resync(s) in the swarm")
    if result["away_s"]:
        print(f"joiner SIGSTOPped {result['away_s']:.0f} s after its first round; merge rounds: "
              + ", ".join(f"{n} {k}" for n, k in result["merge_rounds"].items()))
    for name, at in result["peak_at"].items():
        near = "no merge round" if at["from_merge_s"] is None else f"{at['from_merge_s']:.0f} s from a merge round"
        print(f"{name}: peak at {at['time'] - result['started']:.0f} s, {near}")
    print(f"\n{'peer':5} {'role':9} {'peak PSS MB':>12} {'steady PSS MB':>14} {'peak RSS MB':>12}")
    for name, row in result["memory"].items():
        for role in (*ROLES, "total"):
            cell = row[role]
            rss = row["rss_peak_mb"].get(role) if role != "total" else None
            print(f"{name:5} {role:9} {_mb(cell['peak_mb']):>12} {_mb(cell['steady_mb']):>14} {_mb(rss):>12}")
    per_param = ", ".join(f"{n} {v:.1f}" for n, v in result["bytes_per_param_beyond_16"].items())
    print(f"\ntarget per peer: {result['target_mb_per_peer']:.0f} MB (32 B/param + 1.5 GB); "
          f"peak bytes per parameter beyond model+grads+AdamW (incl. fixed): {per_param}")


def _mb(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    peers = sub.add_parser("peers", help="2 founders and a joiner: memory per process, rounds, the join")
    peers.add_argument("--size", choices=sorted(SIZES), default="tiny")
    peers.add_argument("--duration", type=float, default=60.0, help="seconds after the joiner's download")
    peers.add_argument("--away", type=float, default=0.0,
                       help="SIGSTOP the joiner this many seconds after its first round: its return is a merge round")
    join = sub.add_parser("join", help="joiners download the state of several sources: seconds and MB/s")
    join.add_argument("--size", choices=sorted(SIZES), default="tiny")
    join.add_argument("--sources", type=int, default=3)
    join.add_argument("--repeats", type=int, default=2, help="joiners, one after the other")
    join.add_argument("--leave", action="store_true", help="SIGKILL a source 1 s into each download")
    join.add_argument("--stop", action="store_true", help="one more joiner, SIGTERMed 1 s into its download")
    join.add_argument("--manifest-only", action="store_true",
                      help="joiners hold only the manifest of --data (a prepared DIR): shards come from the sources")
    join.add_argument("--rate-mbit", type=float, default=0.0,
                      help="each source in a network namespace behind this limit (needs root); 0 = loopback")
    sweep = sub.add_parser("swarm", help="2..16 paced tiny peers: group sizes, rounds/min, round time, DHT bytes")
    sweep.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    sweep.add_argument("--duration", type=float, default=120.0, help="seconds each swarm trains")
    sweep.add_argument("--slowdown", type=float, default=8.0, help="each peer sleeps (slowdown-1) x its step time")
    sweep.add_argument("--plot", default="", help="PNG of the four figures against the swarm size")
    sweep.add_argument("--target-group", type=int, default=0,
                       help="target_group_size (default: the preset's, 8; past it, groups are lines of a grid)")
    sweep.add_argument("--steps", type=int, default=0,
                       help="stop each peer after this many inner steps (equal tokens; --duration then only bounds it)")
    sweep.add_argument("--inner-steps", type=int, default=0, help="H (default: 30)")
    sweep.add_argument("--aggregation", choices=["mean", "centered_clip"], default="",
                       help="the reducers' rule (default: the preset's, centered_clip)")
    sweep.add_argument("--total-steps", type=int, default=0,
                       help="the inner lr's cosine length (default: the preset's); short: the lr decays in the run")
    sweep.add_argument("--rescore", action="store_true",
                       help="recompute the table of the runs in --out from their metrics files (runs nothing)")
    sweep.add_argument("--rate-mbit", type=float, default=0.0,
                       help="each peer in its own network namespace behind this limit (tc tbf, both directions)")
    sweep.add_argument("--peer-args", default="", help="more flags for every peer, one string "
                                                       "(e.g. \"--allreduce-timeout 40\")")
    sweep.add_argument("--no-grid", action="store_true", help="groups of whoever is ready, no rotating grid")
    sweep.add_argument("--dht-breakdown", action="store_true",
                       help="count the DHT RPC bytes every node serves, by RPC and kind of key (scripts/dhtcount)")
    sweep.add_argument("--clock-step", default="", metavar="AT:SECONDS",
                       help="step every peer's wall clock SECONDS (forward; negative: back) AT s after their launch")
    sweep.add_argument("--legacy-dht", default="", help="put back hivemind's DHT cache (cache), a progress store "
                                                        "every log interval (stores), its beam of 20 nodes "
                                                        "holding 5 copies (beam) and/or the whole record in the "
                                                        "progress key (records), comma-separated")
    for sub_parser in (peers, join, sweep):
        sub_parser.add_argument("--data", default="", help="corpus file (default: the bundled corpus)")
        sub_parser.add_argument("--out", default="", help="directory for the peers' logs and result.json")
    args = parser.parse_args(argv)
    if args.mode in ("peers", "swarm") and args.duration <= 0:
        parser.error("--duration must be positive")
    if args.mode == "swarm" and args.rescore and not (Path(args.out) / "result.json").is_file():
        parser.error("--rescore needs --out DIR of an earlier swarm run (its result.json)")
    if args.mode == "swarm" and args.inner_steps < 0:
        parser.error("--inner-steps must be positive (0: the default)")
    if args.mode == "swarm" and not all(2 <= n <= 32 for n in args.sizes):
        parser.error("--sizes must be 2..32 peers each")
    if args.mode == "swarm" and not (args.rate_mbit >= 0 and math.isfinite(args.rate_mbit)):
        parser.error("--rate-mbit must be >= 0 (0: loopback, no limit)")
    peer_args = ()
    if args.mode == "swarm":
        try:
            peer_args = tuple(shlex.split(args.peer_args))
        except ValueError as e:
            parser.error(f"--peer-args: {e}")
    if args.mode == "join" and not (1 <= args.sources <= 8 and 1 <= args.repeats <= 10 and args.rate_mbit >= 0):
        parser.error("--sources must be 1..8, --repeats 1..10, --rate-mbit >= 0")
    if args.mode == "join" and args.manifest_only and not (Path(args.data) / "manifest.json").is_file():
        parser.error("--manifest-only needs --data DIR, a directory made by `p2pdiloco prepare`")
    clock_step = None
    if args.mode == "swarm" and args.clock_step:
        try:
            clock_step = tuple(float(x) for x in args.clock_step.split(":"))
        except ValueError:
            clock_step = ()
        if len(clock_step) != 2 or not all(map(math.isfinite, clock_step)) or clock_step[0] < 0:
            parser.error(f"--clock-step takes AT:SECONDS (AT >= 0), got {args.clock_step!r}")
    if args.mode in ("join", "swarm") and args.rate_mbit:
        from netns import available

        ok, why = available()
        if not ok:
            print(f"scale.py: --rate-mbit needs network namespaces: {why}", file=sys.stderr)
            return 2
    from chaos import _terminate
    signal.signal(signal.SIGTERM, _terminate)  # SIGTERM unwinds through the finallys that stop the peers
    out = Path(args.out or tempfile.mkdtemp(prefix="p2pdiloco-scale-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.mode == "peers":
        result = run_peers(args.size, args.duration, out / "peers", args.data, args.away)
        print_peers(result)
    elif args.mode == "swarm" and args.rescore:
        result = rescore_swarm(out)
        print_swarm(result)
        if args.plot:
            plot_swarm(result, Path(args.plot))
    elif args.mode == "swarm":
        result = [run_swarm(n, args.duration, out / f"swarm-{n}", slowdown=args.slowdown, data=args.data,
                            target_group=args.target_group, use_grid=not args.no_grid, legacy_dht=args.legacy_dht,
                            total_steps=args.total_steps, steps=args.steps, clock_step=clock_step,
                            dht_breakdown=args.dht_breakdown, inner_steps=args.inner_steps,
                            aggregation=args.aggregation, rate_mbit=args.rate_mbit,
                            peer_args=peer_args)
                  for n in args.sizes]
        print_swarm(result)
        if args.dht_breakdown:
            print_dht_breakdown(result)
        if args.plot:
            plot_swarm(result, Path(args.plot))
    else:
        result = run_join(args.size, args.sources, args.repeats, out / "peers", rate_mbit=args.rate_mbit,
                          data=args.data, leave=args.leave, stop=args.stop, manifest_only=args.manifest_only)
        print_join(result)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(f"result.json in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
