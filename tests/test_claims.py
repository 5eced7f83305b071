"""Disjoint data through shard claims (data/claims.py), with real peers on loopback: a restarted
peer takes its shard back at its cursor, a killed peer's shard is taken over at its published
cursor once the lease runs out, and no window is read twice meanwhile."""

from __future__ import annotations

import signal
import time
from collections import defaultdict

import pytest

from p2pdiloco.data.prepare import prepare
from p2pdiloco.localswarm import LocalSwarm
from tests.conftest import TINY, make_corpus

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

LEASE_S = 15.0  # claims.py: max(15, 3 x log_interval) with the tiny preset's 2 s interval


def ranges(swarm, name):
    return [r for r in swarm.events(name, "data")]


def overlaps(spans):
    """Windows read twice: overlapping [start, end) cursor ranges of one (epoch, shard)."""
    spans = sorted(spans)
    return sum(max(0, prev_end - start) for (_, prev_end), (start, _) in zip(spans, spans[1:]))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """20 shards of ~100 KB of text as bytes: each takes a tiny peer several log intervals to read."""
    root = tmp_path_factory.mktemp("claims")
    corpus = make_corpus(root / "corpus.txt", size=2_000_000, seed=3)
    manifest = prepare([str(corpus)], root / "tokens", tokenizer="bytes", shard_mb=0.1, eval_fraction=0.02,
                       workers=1, progress=lambda _: None)
    return root / "tokens", {i: (s.tokens - 1) // 64 for i, s in enumerate(manifest.train)}


def inside(swarm, name, windows, at_least):
    """At least `at_least` ranges read, the last one ending inside its shard (not at a shard's end,
    after which the peer holds a new shard that no record names yet)."""
    got = ranges(swarm, name)
    return len(got) >= at_least and got[-1]["end"] < windows[got[-1]["shard"]]


def test_restart_takes_its_shard_back_and_a_dead_peers_shard_is_taken_over(tmp_path, tokens):
    """b, restarted from its checkpoint with its identity, reads on in the shard it was reading, at
    its published cursor; killed for good, its shard goes to a at that cursor after the lease."""
    tokens, windows = tokens
    ident = ["--identity-path", str(tmp_path / "b.key"), "--checkpoint-dir", str(tmp_path / "b.ckpt"),
             "--checkpoint-every", "1"]
    args = ["--data", str(tokens), "--inner-steps", "20", "--state-timeout", "5"]
    with LocalSwarm(tmp_path, config=TINY, extra_args=args) as swarm:
        swarm.start("a")
        swarm.start("b", *ident, join="a")
        swarm.wait_for(lambda: swarm.events("b", "outer") and inside(swarm, "b", windows, 3), timeout=90,
                       what="b averaging and reading")
        swarm.signal("b", signal.SIGKILL)
        before = ranges(swarm, "b")
        last = before[-1]  # its last renewal published this cursor
        swarm.start("b", *ident, join="a")
        swarm.wait_for(lambda: len(ranges(swarm, "b")) > len(before), timeout=60, what="b reading again")
        again = ranges(swarm, "b")[len(before)]
        assert (again["epoch"], again["shard"], again["start"]) == (last["epoch"], last["shard"], last["end"]), \
            (last, again)
        assert swarm.events("b", "resume"), "b did not resume from its checkpoint"

        swarm.wait_for(lambda: inside(swarm, "b", windows, len(before) + 2), timeout=60, what="b renewing")
        swarm.signal("b", signal.SIGKILL)
        dead = ranges(swarm, "b")[-1]
        t_kill = time.time()

        def taken_over():
            return [r for r in ranges(swarm, "a") if (r["epoch"], r["shard"]) == (dead["epoch"], dead["shard"])
                    and r["time"] > t_kill]

        swarm.wait_for(taken_over, timeout=LEASE_S + 60, what="a taking b's shard over")
        first = min(taken_over(), key=lambda r: r["time"])
        assert first["start"] == dead["end"], (dead, first)  # at b's published cursor, not from 0
        assert first["time"] - t_kill >= LEASE_S - 3  # not before b's lease ran out (clock and log slack)

        spans = defaultdict(list)
        for name in ("a", "b"):
            for r in ranges(swarm, name):
                spans[r["epoch"], r["shard"]].append((r["start"], r["end"]))
        assert all(overlaps(s) == 0 for s in spans.values()), {k: v for k, v in spans.items() if overlaps(v)}
        assert len({k[1] for k in spans}) >= 4  # several shards read, never one twice
