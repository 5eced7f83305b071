"""scripts/bench.py at its --quick size: every comparison runs end to end with real peers, real
gloo DDP and (as root) real network namespaces, and writes results.json, results.md and plots.
The quick numbers mean nothing; only the structure and a few robust orderings are checked."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from netns import available  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def test_every_comparison_runs_at_quick_size(tmp_path, corpus):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "all", "--quick", "--out", str(out),
                           "--data", str(corpus)], capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    results = json.loads((out / "results.json").read_text())
    comps = results["by_seed"]["0"]
    assert set(comps) == {"quality", "traffic", "stragglers", "slowlinks", "overhead"}

    quality = comps["quality"]["runs"]
    assert set(quality) == {"ddp", "sync_h50", "decoupled_h50", "decoupled_h50_int8", "decoupled_h50_int4",
                            "per_contribution_h50"}  # the pair at 2H: not at the quick size
    for name, run in quality.items():
        assert math.isfinite(run["final_eval"]) and run["tokens"] > 0, name
        # every mode learns something in 60 steps, except the negative control (one outer step per
        # contribution, its momentum applied once per member): built to do badly, it ended at 5.59 and
        # 7.99 nats (above uniform, 5.55) in two CI runs, 10.4 right after its first outer step; it must
        # only stay finite and not blow up
        bound = math.log(256) * (3.0 if name == "per_contribution_h50" else 1.0)
        assert run["final_eval"] < bound, name
    # every mode took part in rounds (the quick size has H = 15 and 60 steps per peer)
    for name in ("sync_h50", "decoupled_h50", "decoupled_h50_int8", "decoupled_h50_int4", "per_contribution_h50"):
        assert any(p["outer_steps_applied"] > 0 for p in quality[name]["peers"].values()), name

    stragglers = comps["stragglers"]["runs"]
    # synchronous DiLoCo waits for the 4x slower peer; the decoupled swarm does not
    assert (stragglers["straggler_decoupled"]["throughput_vs_own_speeds"]
            > stragglers["straggler_sync"]["throughput_vs_own_speeds"])

    for overhead in comps["overhead"]["by_inner_steps"].values():
        assert overhead["peer_step_ms"] > 0 and overhead["bare_step_ms"] > 0

    ok, why = available()
    if ok:
        traffic = comps["traffic"]
        ddp = traffic["runs"]["ddp"]["wire_sent_per_step"]
        for codec in ("fp16", "int8", "int4"):
            assert 0 < traffic["runs"][codec]["wire_sent_per_step"] < ddp, codec
        slow = comps["slowlinks"]
        assert slow["runs"]["ddp"]["wire_sent_per_step"] > slow["runs"]["p2pdiloco"]["wire_sent_per_step"]
        assert 0 < slow["utilization"] <= 1
    else:  # without root the two network comparisons say why instead of failing
        assert comps["traffic"]["skipped"] == why and comps["slowlinks"]["skipped"] == why

    md = (out / "results.md").read_text()
    for section in ("### quality", "### traffic", "### stragglers", "### slow links", "### overhead"):
        assert section in md
    assert "FAILED" not in md
    for png in ("quality-seed0.png", "stragglers-seed0.png"):
        assert (out / png).stat().st_size > 10_000


def test_gpu_check_says_plainly_when_there_is_no_gpu(tmp_path):
    import torch

    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "gpu", "--quick", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    gpu = json.loads((tmp_path / "results.json").read_text())["by_seed"]["0"]["gpu"]
    if not torch.cuda.is_available():
        assert gpu == {"skipped": "no CUDA device", "bench_s": gpu["bench_s"]}
    else:
        assert gpu["inner_tokens_per_s"] and gpu["overhead_pct"] is not None


def test_ablation_and_sweep_run_at_quick_size(tmp_path, corpus):
    out = tmp_path / "bench"
    # one variant (the suite's time: each variant is 2 more swarms); which keys a variant sets is checked below
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "ablation", "sweep", "--quick",
                           "--variants", "all", "--out", str(out), "--data", str(corpus)],
                          capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    comps = json.loads((out / "results.json").read_text())["by_seed"]["0"]
    ablation = comps["ablation"]
    assert set(ablation["runs"]) == {"ddp", "sync_h15", "sync_h30", "all_h15", "all_h30"}
    assert ablation["variants"]["all"] == {"merge_anchors": True, "full_groups": True, "matchmaking_lead": False,
                                           "eager_outer": True, "dynamic_inner_steps": False, "schedule": True}
    from bench import variant
    assert variant("none") == {"merge_anchors": False, "full_groups": False, "matchmaking_lead": False,
                               "eager_outer": False, "dynamic_inner_steps": False, "schedule": False}
    assert variant("no_schedule")["schedule"] is False and variant("no_schedule")["full_groups"] is True
    for name, run in ablation["runs"].items():
        assert math.isfinite(run["final_eval"]) and run["final_eval"] < math.log(256), name
        if name != "ddp":
            assert 0 <= run["full_group_fraction"] <= 1 and run["resyncs"] >= 0 and run["merges"] >= 0, name
    assert {g["what"] for g in ablation["gaps_pct"]} >= {"all_h15 vs sync_h15", "sync_h30 vs ddp"}
    # the baseline runs at its own tuned outer optimizer, the swarm at the preset's (since the schedule: the same)
    assert (ablation["runs"]["sync_h15"]["outer_lr"], ablation["runs"]["sync_h15"]["outer_momentum"]) == (1.0, 0.6)
    assert (ablation["runs"]["all_h15"]["outer_lr"], ablation["runs"]["all_h15"]["outer_momentum"]) == (1.0, 0.6)
    sweep = comps["sweep"]
    assert len(sweep["runs"]) == 2 and set(sweep["best"]) == {"sync", "decoupled"}  # the quick size's 1 cell
    cell = sweep["runs"]["sync_lr0p5_m0p9"]
    assert (cell["outer_lr"], cell["outer_momentum"]) == (0.5, 0.9)
    md = (out / "results.md").read_text()
    assert "### ablation: mean over 1 seed(s)" in md and "### sweep" in md and "FAILED" not in md


def test_hivemind_study_runs_at_quick_size(tmp_path, corpus):
    """hivemind.Optimizer side by side with the swarm (scripts/hivemind_baseline.py under bench.py): real
    hivemind peers on 127.0.0.1 average their parameters at each epoch's end, in groups of all of them;
    a SIGKILLed peer does not stop the others; nothing outlives the benchmark. Paced (slowdown 10):
    unpaced, a tiny epoch is shorter than a hivemind round and its epochs degenerate (the script's
    tuning note)."""
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "hivemind", "--quick", "--set",
                           "slowdown=10", "--out", str(out), "--data", str(corpus)],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    study = json.loads((out / "results.json").read_text())["by_seed"]["0"]["hivemind"]
    runs = study["runs"]
    assert set(runs) == {"p2pdiloco", "hivemind", "p2pdiloco_kill", "hivemind_kill"}
    hm = runs["hivemind"]
    # 60 steps of 2 peers at H = 15: about 4 epochs; every round that returned held both peers
    assert len(hm["epochs"]) == 2 and min(hm["epochs"]) >= 2, hm
    assert all(sizes and set(sizes) == {2} for sizes in hm["group_sizes"]), hm
    assert runs["hivemind_kill"]["killed"] == 1 and len(runs["hivemind_kill"]["epochs"]) == 1
    assert runs["p2pdiloco_kill"]["killed"] == "b" and set(runs["p2pdiloco_kill"]["peers"]) == {"a"}
    back = runs["p2pdiloco_kill"]["rounds_to_full_after_kill"]  # a lone survivor holds every survivor
    assert set(back) == {"a"} and (back["a"] is None or back["a"] >= 1), back
    assert "rounds_to_full_after_kill" not in runs["p2pdiloco"]
    for name, run in runs.items():
        assert run["final_eval"] is not None and math.isfinite(run["final_eval"]), name
        assert run["tokens"] > 0 and run["wall_s"] > 0 and run["curve"], name
        # the swarm's survivor of 2 is alone after the kill: its anchor stays where its last group left it,
        # which at this size may be the first outer step's overshoot (loss ~8 seen); the others learned
        if name != "p2pdiloco_kill":
            assert run["final_eval"] < math.log(256), name
    assert [p["what"].split(",")[0].split(" (")[0] for p in study["pairs"]] == ["equal tokens", "equal wall time"] * 2
    md = (out / "results.md").read_text()
    assert "### hivemind.Optimizer" in md and "FAILED" not in md
    assert (out / "hivemind-seed0.png").stat().st_size > 10_000
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert left == [], left  # every worker, DHT and p2pd of the benchmark's runs is gone


def test_rounds_to_full_counts_rounds_after_the_kill_until_one_holds_every_survivor():
    from bench import rounds_to_full

    def outer(t, size):
        return {"event": "outer", "time": t, "group_size": size}

    records = {"a": [outer(1, 3), {"event": "round_failed", "time": 12}, outer(13, 1), outer(14, 2)],
               "b": [outer(1, 3), outer(11, 1), outer(14, 2)],
               "c": [outer(1, 3)]}
    # c died at t=10: a's third round after it (one failed, one alone) held a and b, b's second
    assert rounds_to_full(records, {"a", "b"}, kill_t=10) == {"a": 3, "b": 2}
    assert rounds_to_full(records, {"a", "b"}, kill_t=14) == {"a": None, "b": None}


def test_end_of_run_compares_the_final_anchor_with_the_last_one_every_peer_averaged_into():
    from bench import end_of_run_pct

    # the run's 3 peers averaged together until outer step 2 (step 2 not evaluated), then 2 went on
    outer = [{"group_size": 3, "eval_loss": 2.0}, {"group_size": 3, "eval_loss": None},
             {"group_size": 2, "eval_loss": 2.5}]
    assert end_of_run_pct(outer, 2.2, peers=3) == pytest.approx(10.0)
    assert end_of_run_pct(outer, 1.9, peers=3) == pytest.approx(-5.0)
    assert end_of_run_pct(outer, math.inf, peers=3) == math.inf   # diverged
    assert end_of_run_pct(outer[2:], 2.5, peers=3) is None         # never a whole group


@pytest.mark.timeout(120)
def test_byzantine_study_runs_at_quick_size(tmp_path, corpus):
    """bench.py byzantine at its quick size: 3 peers, the last one attacking (P2PDILOCO_TEST_ATTACK, its
    environment alone), under the mean and centered clipping; each run summarizes the honest peers only.
    The structure is checked, that the clean runs' numbers are finite, and one figure: the sign-flipper's
    honest peers end near their clean swarm alone under the robust rule, and far from it under the mean."""
    out = tmp_path / "bench"
    # outer momentum 0 at this size: the group average itself, which cannot overshoot the members' models
    # (at 3 outer steps, 1.0 / 0.6 once left every 3-peer run of a CI study near 8.5, clean ones included,
    # the 2-peer control at 3.0); what is checked, the robust rule against a sign flip, does not depend on it
    # matchmaking_time 4 s (the preset's 2): in CI at 846f870 the sign-flipper's run began with a group of a and the
    # attacker alone, b (entered 1.8 s after them, under the load of six swarms at once) missed in it; a pair under
    # the robust rule is a mean (nothing tells which of two is wrong: docs/security.md, "A pair is a mean"), so the
    # flip went into a's anchor and the honest peers ended 1.57x their control. The wider window was first tried
    # at 2730a93 and lost the clean run's only round in CI to the lost join (docs/scale.md, "The lost round, found
    # and fixed"), fixed since
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "byzantine", "--quick", "--out",
                           str(out), "--data", str(corpus), "--set", "outer_momentum=0",
                           "--set", "matchmaking_time=4"],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    study = json.loads((out / "results.json").read_text())["by_seed"]["0"]["byzantine"]
    runs = study["runs"]
    assert set(runs) == {"clean_mean", "clean_centered_clip", "control_centered_clip", "signflip5_mean",
                         "signflip5_centered_clip", "lie4_centered_clip"}
    assert study["peers"] == 3
    for name, run in runs.items():
        assert "error" not in run, run.get("error")
        assert run["colluders"] == (0 if run["attack"] in ("clean", "control") else 1), name
        # the attacker (peer c) is out of the summary; its peer id is known, so its groups can be told. The
        # control is the honest peers alone: a and b, no c
        assert set(run["peers"]) == ({"a", "b", "c"} if run["attack"] == "clean" else {"a", "b"}), name
        if run["attack"] not in ("clean", "control"):
            assert run["outsiders"]["c"]["peer_id"], name
        assert set(run["defence"]) == {"clipped_attacker", "clipped_honest", "banned_attacker", "banned_honest",
                                      "reducer_check", "anchor_clipped_honest", "honest_clip_share", "rounds"}, name
        # unpaced, 3 contributions a peer (with 2, one round lost to a matchmaking race under the load of 6
        # swarms at once left a clean run with no outer step: its settled eval inf); overshoot may still show
        if run["attack"] == "clean":
            assert math.isfinite(run["final_eval"]) and math.isfinite(run["ratio"]) and run["round_s"] > 0, name
    assert runs["clean_mean"]["ratio"] == 1.0
    checks = {c["what"]: c for c in study["checks"]}
    assert "clean centered_clip: round time / clean mean's" in checks
    # the end of a run: the worst honest final anchor against the last one a group of every honest peer made
    end = checks["clean (centered_clip): the worst honest kept model over the last whole group's anchor (%)"]
    assert end["value"] == runs["clean_centered_clip"]["end_of_run_pct"]
    assert any(what.startswith("lie:4") for what in checks)
    # the attacked swarm ran to its end: the honest peers' final eval against their clean swarm alone (the
    # model each keeps). The robust rule holds it near the control; the mean, whose average the -5x sender
    # turns around, does not
    control = checks["signflip:5 (centered_clip): the honest peers' kept model / their clean swarm's alone "
                     "(control), final eval"]
    kept = {name: run["kept_eval"] for name, run in runs.items()}
    assert control["value"] == pytest.approx(kept["signflip5_centered_clip"] / kept["control_centered_clip"])
    # 3 runs at this size: 1.04-1.14 under the rule, 1.34-1.60 under the mean (the mean's kept model 24-43% worse
    # than the rule's); a 3-peer run's eval varies by ~15% between reruns here, hence the margins
    assert control["value"] <= 1.5, kept
    assert kept["signflip5_mean"] > kept["signflip5_centered_clip"], kept
    md = (out / "results.md").read_text()
    assert "### byzantine (1 attacker(s) of 3 peers" in md and "FAILED" not in md
    assert (out / "byzantine-seed0.png").stat().st_size > 10_000
    # --rescore recomputes the figures from the runs' metrics on disk, running nothing: the same numbers
    rescored = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "byzantine", "--rescore",
                               "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert rescored.returncode == 0, rescored.stderr[-3000:]
    again = json.loads((out / "results.json").read_text())["by_seed"]["0"]["byzantine"]
    for name, run in runs.items():
        assert again["runs"][name]["settled_eval"] == pytest.approx(run["settled_eval"]), name
    assert [c["met"] for c in again["checks"]] == [c["met"] for c in study["checks"]]


def _peer_groups(out: Path) -> set[int]:
    """Process groups of the `p2pdiloco join` processes whose logs go under `out` (each leads its group)."""
    groups = set()
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        if "p2pdiloco join" in cmd and str(out) in cmd:
            groups.add(int(entry.name))
    return groups


@pytest.mark.timeout(180)
def test_a_sigterm_stops_every_swarm_of_a_benchmark(tmp_path, corpus):
    """bench.py runs its swarms in worker threads, which a signal does not reach: on SIGTERM every
    thread's swarm stops its peers (localswarm.STOPPING), and nothing of them is left: no trainer, no
    DHT or averager process, no p2pd (all in the peers' process groups)."""
    import signal
    import time

    from p2pdiloco.localswarm import group_members

    out = tmp_path / "bench"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench.py"), "ablation", "--quick",
                             "--variants", "all", "--no-baselines", "--out", str(out), "--data", str(corpus)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    groups: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:  # both swarms (H and 2H) up, 2 peers each
            groups |= _peer_groups(out)
            if len(groups) >= 4 and len(list(out.glob("runs/*/*/metrics.jsonl"))) >= 4:
                break
            time.sleep(0.5)
        assert len(groups) >= 4 and proc.poll() is None, (groups, proc.poll())
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        stopped_s = time.monotonic() - t0
        time.sleep(1.0)  # a process group's last members may take a moment to exit after the script
        left = {pgid: group_members(pgid) for pgid in groups}  # before the cleanup below
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pgid in groups:  # whatever the script left (it should leave nothing)
            for pid in group_members(pgid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert not any(left.values()), left
    assert proc.returncode == 1 and "bench: stopped" in err, (proc.returncode, err[-2000:])
    assert stopped_s <= 30, stopped_s  # the peers honour SIGTERM within 10 s; LocalSwarm waits up to 15
    assert "Traceback" not in err, err[-2000:]
