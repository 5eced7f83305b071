"""scripts/chaos.py end to end, in a tiny setting: 3 real peers for 35 s, a fault every ~10 s."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT, make_corpus

pytestmark = pytest.mark.chaos


def _entry(t: float, size: int = 0) -> dict:
    """A round entered at t and over 1 s later: applied in a group of `size`, or failed (size 0)."""
    return {"event": "outer" if size else "round_failed", "entered": t, "time": t + 1.0, "group_size": size}


def test_rounds_to_whole_counts_each_survivors_rounds_after_a_change():
    """3 peers; c is killed at 20.5: a's round in flight fails, its next is whole (2 rounds), b's first is
    whole (1); the median of 1 and 2. d joins at 40 and is in a's and b's groups 2 rounds later (b) and
    never for a within the run. With one dimension, a group of every live peer up to the target."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import chaos
    lives = {
        "a": [[_entry(10, 3), _entry(20, 0), _entry(30, 2), _entry(40, 2), _entry(50, 2)]],
        "b": [[_entry(10, 3), _entry(21, 2), _entry(30, 2), _entry(40, 2), _entry(50, 3)]],
        "c": [[_entry(10, 3), _entry(19.4, 0)]],  # its last event before the kill
        "d": [[_entry(40, 0), _entry(50, 3)]],
    }
    assert chaos.rounds_to_whole(lives, [20.5, 40.0], target=8) == [1.5, None]
    # the target caps what a whole group holds: 2 of 3 live peers is whole at a target of 2
    assert chaos.rounds_to_whole(lives, [40.0], target=2) == [1]


def test_a_frozen_peers_thaw_is_a_change_of_the_swarm():
    """A freeze changes the swarm when the peer comes back (its SIGCONT), not when it stops: from then on
    a whole group holds it again. A thaw after the run's end is no change."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import chaos
    record = chaos.RunRecord(workdir=ROOT, t_start=100.0, t_end=200.0,
                             faults=[{"t": 10.0, "kind": "freeze", "name": "a", "for_s": 5.0},
                                     {"t": 30.0, "kind": "kill", "name": "b"},
                                     {"t": 98.0, "kind": "freeze", "name": "c", "for_s": 5.0}])
    assert chaos._changes(record, {}) == [115.0, 130.0]


@pytest.mark.timeout(300)
def test_chaos_script_small_run(tmp_path):
    corpus = make_corpus(tmp_path / "corpus.txt")
    workdir = tmp_path / "chaos"
    cmd = [sys.executable, str(ROOT / "scripts" / "chaos.py"), "--peers", "3", "--duration", "35",
           "--fault-every", "10", "--seed", "3", "--workdir", str(workdir), "--data", str(corpus),
           "--freeze", "3", "--", "--inner-steps", "30"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the script stops its peers in `finally`
        try:
            out, _ = proc.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"chaos.py did not finish in time:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]

    report = json.loads((workdir / "chaos.json").read_text())
    for key in ("faults", "rounds_applied", "rounds_failed", "longest_stall_s", "goodput", "tail_eval_loss",
                "final_vs_last_whole", "kept_vs_last_whole", "hard_clips", "removed_mean", "rounds_to_whole"):
        assert key in report, (key, sorted(report))
    assert math.isfinite(report["kept_eval_loss"]), report["kept_eval_loss"]  # the model the live peers keep
    assert report["bans"] == 0, "an honest peer was banned under churn"
    assert report["faults"]["total"] >= 1, report["fault_log"]
    assert sum(report["faults"][k] for k in ("kill", "kill_restart", "join", "freeze")) == report["faults"]["total"]
    assert report["rounds_applied"] >= 1, out[-4000:]
    assert 0 < report["goodput"] <= 1, report["goodput"]
    assert report["ok"] is True
    assert "| longest stall (s) |" in out
    # an earlier run's chaos.json gets this version's measures from its metrics files, unchanged
    again = subprocess.run([sys.executable, str(ROOT / "scripts" / "chaos.py"), "--workdir", str(workdir),
                            "--reanalyze"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((workdir / "chaos.json").read_text())["tail_eval_loss"] == report["tail_eval_loss"]
    assert "| bans; pseudo-gradients clipped hard (< 0.5) |" in again.stdout
