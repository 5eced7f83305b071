"""CLI end to end: real `p2pdiloco join` processes on 127.0.0.1.

One swarm per module (it costs a minute of the two cores): three peers train and average, a
fourth joins late through a peer that is not the first, and a peer is stopped with SIGTERM.
"""

from __future__ import annotations

import math
import signal
import time

import pytest

from p2pdiloco.localswarm import LocalSwarm
from tests.conftest import TINY, evaluated, group_left

pytestmark = pytest.mark.timeout(360)

RANDOM_INIT_LOSS = math.log(256)  # ~5.55: a byte model that knows nothing


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, corpus):
    workdir = tmp_path_factory.mktemp("swarm")
    with LocalSwarm(workdir, config=TINY, extra_args=["--data", str(corpus), "--inner-steps", "30"]) as s:
        s.start("a")
        s.start("b", join="a")
        s.start("c", join="a")
        yield s


def outer_steps(swarm, name):
    return [r["outer_step"] for r in swarm.events(name, "outer")]


def test_three_peers_average_and_loss_falls(swarm):
    def trained(name: str) -> bool:  # under load the first rounds can carry a lone peer's long solo run
        outer = swarm.events(name, "outer")
        losses = [r["eval_loss"] for r in evaluated(outer)]
        return len(outer) >= 3 and bool(losses) and losses[-1] < RANDOM_INIT_LOSS - 1.0

    swarm.wait_for(lambda: all(trained(n) for n in "abc"), timeout=150,
                   what="3 outer steps and an eval loss 1 below random init on every peer")
    for name in "abc":
        outer = swarm.events(name, "outer")
        assert all(r["group_size"] >= 2 for r in outer), outer
        assert all(r["bytes_sent"] > 0 and r["bytes_recv"] > 0 for r in outer[1:]), outer
        # anchors in a round agree (sampled values, relative distance), or the odd ones out resync
        assert all(r["anchor_spread"] < 1e-3 or r["diverged_members"] > 0 for r in outer), outer
        # b and c start from a's state when they come up late under load, so compare with random init
        inner = swarm.events(name, "inner")
        assert inner[-1]["loss"] < RANDOM_INIT_LOSS - 2.0, inner[-1]
        # the training thread's time at round boundaries (the snapshot, the corrections, the landing) is
        # counted apart from the steps' (in every record after the first outer step); evaluations run in
        # their own thread, not in this one
        late = [r for r in inner if r["time"] > outer[0]["time"]]
        assert late and all(0 < r["outer_s"] < r["compute_s"] and r["eval_s"] == 0 for r in late), late
        assert evaluated(outer)[-1]["eval_loss"] < RANDOM_INIT_LOSS - 1.0
    inner_a = swarm.events("a", "inner")  # a started the swarm: its training loss fell from near random init
    assert inner_a[-1]["loss"] < inner_a[0]["loss"] - 0.5, (inner_a[0]["loss"], inner_a[-1]["loss"])
    # peers at the same outer step evaluate the same anchor: equal eval losses
    by_step = {}
    for name in "abc":
        for r in evaluated(swarm.events(name, "outer")):
            by_step.setdefault(r["outer_step"], []).append(r["eval_loss"])
    shared = {k: v for k, v in by_step.items() if len(v) >= 2}
    assert shared, by_step
    for step, losses in shared.items():
        assert max(losses) - min(losses) < 0.02, (step, losses)


def test_late_joiner_loads_state_first(swarm):
    swarm.wait_for(lambda: max(outer_steps(swarm, "a") or [0]) >= 3, timeout=150, what="outer step 3")
    # one batch's loss swings by ~0.7 on this small corpus (a: 1.06, 0.57, 0.94, 0.34), so the swarm's
    # level is the worst of its last few batches, not one
    swarm_loss = max(r["loss"] for n in "ab" for r in swarm.events(n, "inner")[-4:])
    swarm.start("d", join="b")  # any live peer will do, not only the first
    swarm.wait_for(lambda: swarm.events("d", "join") and swarm.events("d", "inner"), timeout=90,
                   what="d joined and trained")
    join = swarm.events("d", "join")[0]
    assert join["loaded_outer_step"] >= 1
    first_loss = swarm.events("d", "inner")[0]["loss"]
    assert first_loss < swarm_loss + 0.5, (first_loss, swarm_loss)
    assert first_loss < RANDOM_INIT_LOSS - 1.5
    swarm.wait_for(lambda: len(swarm.events("d", "outer")) >= 1, timeout=90, what="d's first outer step")
    assert swarm.events("d", "outer")[0]["outer_step"] > join["loaded_outer_step"]


def test_sigterm_stops_cleanly(swarm):
    swarm.wait_for(lambda: len(swarm.events("c", "outer")) >= 2, timeout=120, what="c trained")
    pgid = swarm.peers["c"].pgid
    t0 = time.monotonic()
    swarm.signal("c", signal.SIGTERM, whole_group=False)
    code = swarm.wait_exit("c", timeout=20)
    took = time.monotonic() - t0
    assert code == 0, swarm.stderr("c")
    assert took < 10, took
    assert group_left(pgid) == [], "p2pd or a hivemind child outlived the peer"
    final = swarm.events("c", "final")
    assert final, "the last step evaluates"
    # the anchor and the model c keeps (its anchors' average) are both evaluated; after 2+ outer steps of its
    # own they differ, unless a download (a resync) started the average again from the anchor since
    assert math.isfinite(final[0]["eval_loss"]) and math.isfinite(final[0]["kept_eval_loss"])
    if not swarm.events("c", "resync"):
        assert final[0]["kept_eval_loss"] != final[0]["eval_loss"]
    # the others go on without it
    before = max(outer_steps(swarm, "a"))
    swarm.wait_for(lambda: max(outer_steps(swarm, "a")) >= before + 2, timeout=90, what="a continues")
