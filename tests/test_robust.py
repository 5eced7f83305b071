"""The robust rule and the reducer check against hand-made inputs (pure math), and the ban rule."""

from __future__ import annotations

import math
import time

import pytest
import torch

from p2pdiloco import robust
from p2pdiloco.allreduce import RoundReport
from p2pdiloco.averaging import RoundOutcome
from p2pdiloco.suspects import BAN_BAD, BAN_WINDOW, Suspects


def honest(count: int, m: int = 2048, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    mu = torch.randn(m, generator=generator)
    return mu + torch.randn(count, m, generator=generator)


def test_without_outliers_it_is_close_to_the_mean():
    g = honest(5)
    clipped = robust.centered_clip(g, torch.ones(5))
    mean = g.mean(0)
    assert float((clipped.average - mean).norm() / mean.norm()) < 0.05
    assert min(clipped.scales) > 0.9


def test_one_sender_pulls_the_result_by_at_most_about_tau_whatever_it_sends():
    """Sign flips of any size, and a vector at the honest norm in a random direction: the distance of
    the result from the honest mean stays under tau (a mean moves by 1/5 of the attack)."""
    g = honest(5)
    honest_mean = g[:4].mean(0)
    for attack in (-1.0, -5.0, -100.0, -1e4):
        g[4] = attack * g[4].abs()
        clipped = robust.centered_clip(g, torch.ones(5))
        moved = float((clipped.average - honest_mean).norm())
        assert moved < clipped.tau, (attack, moved, clipped.tau)
        if attack <= -5:
            assert clipped.scales[4] < robust.HARD_CLIP
            assert float((g.mean(0) - honest_mean).norm()) > moved


def test_the_coordinate_median_is_torchs_lower_median_for_any_group():
    """The sorting network gives exactly torch's median(dim=0) (the lower one for an even count): every
    group size up to past the network's limit, distinct values and ties."""
    generator = torch.Generator().manual_seed(1)
    for n in range(1, robust.MEDIAN_NETWORK_ROWS + 3):
        for g in (torch.randn(n, 257, generator=generator),
                  torch.randint(0, 3, (n, 257), generator=generator).float()):
            assert torch.equal(robust.coordinate_median(g), g.median(dim=0).values), n


def test_two_senders_or_fewer_get_the_weighted_mean():
    g = honest(2)
    clipped = robust.centered_clip(g, torch.tensor([1.0, 3.0]))
    torch.testing.assert_close(clipped.average, (g[0] + 3 * g[1]) / 4)
    assert clipped.tau == math.inf


def test_senders_of_weight_zero_take_no_part():
    g = honest(4)
    g[3] = 1e6
    clipped = robust.centered_clip(g, torch.tensor([1.0, 1.0, 1.0, 0.0]))
    assert float(clipped.average.abs().max()) < 100
    assert clipped.scales[3] == 1.0  # not judged: it was not used


def _terms(g: torch.Tensor, v: torch.Tensor, weights: list, tau=None) -> list:
    dists = [float((x - v).norm()) for x in g]
    tau = robust.tau_of(dists) if tau is None else tau
    z = robust.directions(b"group/0/nonces", g.shape[1])
    return [robust.fixed_point_terms(x, v, w, tau, z) for x, w in zip(g, weights)]


def test_the_check_passes_a_fixed_point_and_catches_lies_of_a_tenth_of_tau():
    g = honest(5)
    g[4] = -4 * g[4]
    clipped = robust.centered_clip(g, torch.ones(5))
    assert robust.check_statistic(_terms(g, clipped.average, [1.0] * 5)) < robust.CHECK_THRESHOLD / 100
    caught = 0
    for trial in range(20):
        noise = torch.randn(g.shape[1], generator=torch.Generator().manual_seed(trial))
        lie = clipped.average + 0.3 * clipped.tau * noise / noise.norm()
        caught += robust.check_statistic(_terms(g, lie, [1.0] * 5)) > robust.CHECK_THRESHOLD
    assert caught >= 19
    assert robust.check_statistic(_terms(g, -4 * clipped.average, [1.0] * 5)) > robust.CHECK_THRESHOLD


def test_the_check_of_a_plain_mean_is_the_weighted_sum():
    g = honest(3)
    weights = [1.0, 2.0, 3.0]
    mean = sum(w * x for w, x in zip(weights, g)) / sum(weights)
    assert robust.check_statistic(_terms(g, mean, weights, tau=math.inf)) < 1e-3
    assert robust.check_statistic(_terms(g, g.mean(0), weights, tau=math.inf)) > robust.CHECK_THRESHOLD


def test_check_directions_do_not_depend_on_the_reducers_nonce():
    nonces = {"a": 1, "b": 2, "r": 3}
    seed = robust.check_seed("g", 0, nonces, "r")
    assert seed == robust.check_seed("g", 0, {**nonces, "r": 99}, "r")
    assert seed != robust.check_seed("g", 0, {**nonces, "a": 99}, "r")
    assert seed != robust.check_seed("g", 1, nonces, "r")
    z = robust.directions(seed, 100)
    torch.testing.assert_close(z.dense().norm(dim=1), torch.ones(robust.PROJECTIONS))
    assert torch.equal(z.dense(), robust.directions(seed, 100).dense())
    assert not torch.equal(z.dense(), robust.directions(robust.check_seed("g", 1, nonces, "r"), 100).dense())


@pytest.mark.parametrize("length", [1, 7, 100, 1000, 262_143])
def test_check_directions_project_as_their_dense_vectors(length):
    """<x, a (x) b> computed as a^T X b (one pass over x, of any length: padded to p x q) is the dot product
    with the dense direction; a lie of two opposite values (which random signs miss half the time) always
    projects to a nonzero number."""
    z = robust.directions(b"group/0/nonces", length)
    x = torch.randn(length, generator=torch.Generator().manual_seed(length))
    torch.testing.assert_close(z.project(x), z.dense() @ x, rtol=1e-4, atol=1e-5)
    if length >= 2:
        lie = torch.zeros(length)
        lie[0], lie[-1] = 1.0, -1.0
        assert bool((z.project(lie).abs() > 1e-6).all())


class Log:
    def __init__(self):
        self.events = []

    def log(self, event, **fields):
        self.events.append((event, fields))


class Averager:  # records what the trainer tells the averager process
    def __init__(self):
        self.banned = None

    def set_banned(self, peers):
        self.banned = peers


def _round(clipped: dict, members=("me", "x", "y"), bad_reducers=()) -> RoundOutcome:
    report = RoundReport(group_id="g", complete=True, clipped=clipped)
    check = {"ok": not bad_reducers, "bad": list(bad_reducers), "members": list(members), "stat": 0.0}
    return RoundOutcome(ok=True, members={m: {} for m in members}, report=report, check=check)


def test_a_peer_clipped_hard_in_most_of_its_rounds_is_banned_and_the_ban_ends():
    log, averager = Log(), Averager()
    suspects = Suspects(ban_time=0.2, peer_id="me")
    for i in range(BAN_WINDOW):  # x clipped hard every other round (not a majority), y's reducer lies from round 3
        suspects.judge(_round({"x": 0.1} if i % 2 else {"x": 0.9}, bad_reducers=["y"] if i >= 3 else []),
                       log, averager)
    banned = [fields for event, fields in log.events if event == "banned"]
    assert [b["sender"] for b in banned] == ["y"] and BAN_BAD == 5  # y: 5 of 8 bad, x: 4 of 8
    assert "failed the check" in banned[0]["reason"] and averager.banned == ["y"]
    assert sum(e == "bad_contribution" and "clipped" in f["reason"] for e, f in log.events) == BAN_WINDOW // 2
    assert sum(e == "reducer_check" for e, _ in log.events) == BAN_WINDOW
    time.sleep(0.3)
    suspects.sync(averager)  # the ban ran out: the averager hears it
    assert averager.banned == []


def test_a_merge_rounds_anchor_clipped_hard_is_logged_apart_and_still_counts():
    """A merge round's anchor and momentum clipping is reported apart from the pseudo-gradient's (an
    honest minority lineage is clipped to ~0 there by design, docs/security.md), and still counts
    toward a ban: a diverged attacker's anchor was banned that way in the suite's byzantine test."""
    log = Log()
    suspects = Suspects(ban_time=60.0, peer_id="me")
    for _ in range(BAN_WINDOW):
        report = RoundReport(group_id="g", complete=True, merged=True, merge_clipped={"z": 0.0, "y": 0.9},
                             clipped={"x": 0.1})
        suspects.judge(RoundOutcome(ok=True, members={m: {} for m in ("me", "x", "y", "z")}, report=report), log)
    assert sorted(f["sender"] for e, f in log.events if e == "banned") == ["x", "z"]
    reasons = {f["sender"]: f["reason"] for e, f in log.events if e == "bad_contribution"}
    assert reasons["z"].startswith("its anchor or momentum clipped") and reasons["x"].startswith("clipped")
    assert "y" not in reasons


def test_status_lists_the_peers_that_live_peers_banned():
    from p2pdiloco.status import clean_record, format_table

    records = [clean_record({"peer": p, "time": 1.0, "banned": banned})
               for p, banned in (("a", {"x": "clipped hard"}), ("b", {"x": "clipped hard", "y": "excluded"}),
                                 ("c", "not a dict"))]
    text = format_table(records, "run", now=2.0)
    assert "suspect x: banned by 2 of 3 peer(s) (clipped hard)" in text
    assert "suspect y: banned by 1 of 3 peer(s) (excluded)" in text


def test_the_robust_reducer_aggregates_off_the_event_loop():
    """A part's CenteredClip runs in the averager's aggregation thread: the event loop keeps serving (here a
    ticker) while it runs, every sender gets the robust average, the next part opens after it, and an
    aggregation that fails fails its senders' parts instead of hanging them."""
    import asyncio

    from hivemind.averaging.partition import TensorPartReducer

    from p2pdiloco.allreduce import RobustPartReducer, stop_aggregator

    async def main():
        reducer = TensorPartReducer([torch.Size([6]), torch.Size([6])], num_senders=3)
        reducer.__class__ = RobustPartReducer
        reducer.setup(None)
        aggregate, ticks = reducer._aggregate, []

        def slow(index, inputs):
            time.sleep(0.3)  # holds the GIL only in short slices: the loop must keep ticking
            return aggregate(index, inputs)

        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        reducer._aggregate = slow
        parts = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(0))
        tick = asyncio.create_task(ticker())
        try:
            t0 = time.monotonic()
            first = await asyncio.gather(*[reducer.accumulate_part(i, 0, parts[0, i]) for i in range(3)])
            assert sum(t0 < t < time.monotonic() for t in ticks) >= 10
            for average in first:
                torch.testing.assert_close(average, robust.centered_clip(parts[0], torch.ones(3)).average)
            assert reducer.current_part_index == 1
            reducer._aggregate = lambda index, inputs: 1 / 0
            with pytest.raises(ZeroDivisionError):
                await asyncio.gather(*[reducer.accumulate_part(i, 1, parts[1, i]) for i in range(3)])
            assert reducer.finished.is_set()
        finally:
            tick.cancel()

    try:
        asyncio.run(main())
    finally:
        stop_aggregator()
