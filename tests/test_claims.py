"""Disjoint data through shard claims (data/claims.py), with real peers on loopback: a restarted
peer takes its shards back at their cursors, a killed peer's shards are taken over at their
published cursors once the lease runs out, and no window is read twice meanwhile."""

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
    """~40 shards of ~30 KB of text as bytes: a peer reading 4 at once takes several log intervals
    over each, and frees a slot (and looks for free shards) every few seconds."""
    root = tmp_path_factory.mktemp("claims")
    corpus = make_corpus(root / "corpus.txt", size=1_200_000, seed=3)
    manifest = prepare([str(corpus)], root / "tokens", tokenizer="bytes", shard_mb=0.03, eval_fraction=0.02,
                       workers=1, progress=lambda _: None)
    return root / "tokens", {i: (s.tokens - 1) // 64 for i, s in enumerate(manifest.train)}


def last_ends(spans, windows):
    """(epoch, shard) -> the end of the last range read, for shards read but not to their end."""
    ends = {}
    for r in spans:
        ends[r["epoch"], r["shard"]] = max(ends.get((r["epoch"], r["shard"]), 0), r["end"])
    return {k: e for k, e in ends.items() if e < windows[k[1]]}


def test_restart_takes_its_shards_back_and_a_dead_peers_shards_are_taken_over(tmp_path, tokens):
    """b, restarted from its checkpoint with its identity, reads on in the shards it was reading, at
    its published cursors; killed for good, its shards go to a at those cursors after the lease."""
    tokens, windows = tokens
    ident = ["--identity-path", str(tmp_path / "b.key"), "--checkpoint-dir", str(tmp_path / "b.ckpt"),
             "--checkpoint-every", "1"]
    args = ["--data", str(tokens), "--inner-steps", "20", "--state-timeout", "5"]
    with LocalSwarm(tmp_path, config=TINY, extra_args=args) as swarm:
        swarm.start("a")
        swarm.start("b", *ident, join="a")
        # killed while some shard is read partway (its slots switch shards together: not right after)
        swarm.wait_for(lambda: swarm.events("b", "outer") and len(ranges(swarm, "b")) >= 8
                       and last_ends(ranges(swarm, "b"), windows), timeout=90, what="b averaging and reading")
        swarm.signal("b", signal.SIGKILL)
        before = ranges(swarm, "b")
        published = last_ends(before, windows)  # each renewal published these cursors
        swarm.start("b", *ident, join="a")
        swarm.wait_for(lambda: len(ranges(swarm, "b")) >= len(before) + 4, timeout=60, what="b reading again")
        after = ranges(swarm, "b")[len(before):]
        firsts = {}
        for r in after:
            firsts.setdefault((r["epoch"], r["shard"]), r)
        again = {k: r["start"] for k, r in firsts.items() if k in published}
        # at the published cursor (a checkpoint newer than the last renewal reports the windows its
        # model was trained on from there)
        assert again and all(start == published[k] for k, start in again.items()), (published, again)
        assert swarm.events("b", "resume"), "b did not resume from its checkpoint"

        swarm.wait_for(lambda: len(ranges(swarm, "b")) >= len(before) + 12
                       and last_ends(ranges(swarm, "b")[len(before):], windows), timeout=60, what="b renewing")
        swarm.signal("b", signal.SIGKILL)
        # the shards b held when it died: its second life's (one of its first life's that it did not take
        # back in time went to a at its published cursor before this kill, and a reads on there: CI)
        dead = last_ends(ranges(swarm, "b")[len(before):], windows)
        t_kill = time.time()

        def taken_over():
            return [r for r in ranges(swarm, "a") if (r["epoch"], r["shard"]) in dead and r["time"] > t_kill]

        swarm.wait_for(taken_over, timeout=LEASE_S + 60, what="a taking b's shards over")
        first = {}
        for r in sorted(taken_over(), key=lambda r: r["time"]):
            first.setdefault((r["epoch"], r["shard"]), r)
        assert all(r["start"] == dead[k] for k, r in first.items()), (dead, first)  # at b's cursors, not 0
        assert min(r["time"] for r in first.values()) - t_kill >= LEASE_S - 3  # not before the lease ran out

        spans = defaultdict(list)
        for name in ("a", "b"):
            for r in ranges(swarm, name):
                spans[r["epoch"], r["shard"]].append((r["start"], r["end"]))
        assert all(overlaps(s) == 0 for s in spans.values()), {k: v for k, v in spans.items() if overlaps(v)}
        assert len({k[1] for k in spans}) >= 8  # several shards read, never a window twice
