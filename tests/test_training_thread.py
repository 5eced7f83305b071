"""The training thread trains: scripts/boundary_bench.py at its tiny size, 2 real peers on loopback
reading prepared tokens in claimed order. No DHT call is made from the training loop (the data feed
claims shards, the records thread publishes and reads records, the round's thread averages), every
round's boundary cost is logged, and each peer's final record splits its wall time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from p2pdiloco.data.prepare import prepare
from tests.conftest import make_corpus

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
HOOK = Path(__file__).parent / "hooks" / "dht_guard"


def test_no_dht_call_from_the_training_loop_and_the_wall_time_is_split(tmp_path):
    corpus = make_corpus(tmp_path / "corpus.txt", size=600_000, seed=5)
    # small shards: each peer finishes and claims several during the run, in its data feed
    prepare([str(corpus)], tmp_path / "tokens", tokenizer="bytes", shard_mb=0.03, eval_fraction=0.02, workers=1,
            progress=lambda _: None)
    guard = tmp_path / "dht_calls.tsv"
    env = {**os.environ, "DHT_GUARD_FILE": str(guard),
           "PYTHONPATH": os.pathsep.join([str(HOOK), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "boundary_bench.py"), "--size", "tiny", "--peers",
                           "2", "--duration", "20", "--data", str(tmp_path / "tokens"), "--out",
                           str(tmp_path / "result.json")], capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = [line.split("\t") for line in guard.read_text().splitlines()]
    from_loop = [c for c in calls if c[2] == "1"]
    assert not from_loop, from_loop[:5]
    # the guard sees the calls the other threads make: records, claims and rounds did talk to the DHT
    threads = {c[0] for c in calls}
    assert {"swarm-records", "data-feed"} <= threads, threads
    assert any("take" in c[3] for c in calls if c[0] == "data-feed"), calls[:20]

    result = json.loads((tmp_path / "result.json").read_text())
    assert set(result["per_peer"]) == {"a", "b"}, result["exit_codes"]
    for peer in result["per_peer"].values():
        assert peer["rounds_applied"] >= 2, peer
        assert peer["boundary_ms_median"] is not None and peer["boundary_faults_median"] is not None, peer
        split = peer["split"]
        assert set(split) == {"inner_steps", "data", "boundary", "rest"}, split
        assert abs(sum(split.values()) - 1) < 0.01 and split["inner_steps"] > 0.5, split
        assert peer["off_step_s_per_round"] > 0 and peer["thread_faults_per_round"] > 0, peer
    assert "all: boundary median" in proc.stdout
