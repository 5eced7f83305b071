"""The training thread trains: with real peers on loopback reading prepared tokens in claimed order,
no DHT call is made from the training loop (the data feed claims shards, the records thread publishes
and reads records, the round's thread averages), and each peer's final record splits its wall time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from p2pdiloco.data.prepare import prepare
from p2pdiloco.localswarm import LocalSwarm
from tests.conftest import TINY, make_corpus

pytestmark = pytest.mark.timeout(180)

HOOK = Path(__file__).parent / "hooks" / "dht_guard"


def test_no_dht_call_from_the_training_loop_and_the_wall_time_is_split(tmp_path):
    corpus = make_corpus(tmp_path / "corpus.txt", size=600_000, seed=5)
    # small shards: each peer finishes and claims several during the run, in its data feed
    prepare([str(corpus)], tmp_path / "tokens", tokenizer="bytes", shard_mb=0.03, eval_fraction=0.02, workers=1,
            progress=lambda _: None)
    guard = tmp_path / "dht_calls.tsv"
    env = {"DHT_GUARD_FILE": str(guard),
           "PYTHONPATH": os.pathsep.join([str(HOOK), os.environ.get("PYTHONPATH", "")])}
    args = ["--data", str(tmp_path / "tokens"), "--inner-steps", "20", "--max-time", "25"]
    with LocalSwarm(tmp_path, config=TINY, extra_args=args, env=env) as swarm:
        swarm.start("a")
        swarm.start("b", join="a")
        for name in "ab":
            assert swarm.wait_exit(name, timeout=90) == 0, swarm.stderr(name)
        calls = [line.split("\t") for line in guard.read_text().splitlines()]
        from_loop = [c for c in calls if c[2] == "1"]
        assert not from_loop, from_loop[:5]
        # the guard sees the calls the other threads make: records, claims and rounds did talk to the DHT
        threads = {c[0] for c in calls}
        assert {"swarm-records", "data-feed"} <= threads, threads
        assert any("_claim" in c[3] or "take" in c[3] for c in calls if c[0] == "data-feed"), calls[:20]
        for name in "ab":
            assert swarm.events(name, "outer"), swarm.stderr(name)
            assert swarm.events(name, "data"), "no shard was read through claims"
            final = swarm.events(name, "final")[0]
            split = final["split"]
            assert set(split) == {"inner_steps", "data", "boundary", "rest"}, split
            assert abs(sum(split.values()) - 1) < 0.01 and split["inner_steps"] > 0.5, split
            boundaries = swarm.events(name, "boundary")
            assert boundaries and all(b["boundary_s"] >= 0 and b["faults"] >= 0 for b in boundaries), boundaries
            assert "p2pdiloco: wall time inner_steps" in swarm.stderr(name)
