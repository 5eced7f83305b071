"""Rounds on a schedule (p2pdiloco/schedule.py), the pure math: the due time a group agrees on, the
swarm's phase from progress records, and one peer's clock through formed, partial and lonely rounds."""

from __future__ import annotations

import pytest

from p2pdiloco.schedule import Clock, agreed, swarm_phase

pytestmark = pytest.mark.timeout(30)


def test_group_agrees_on_the_median_due_and_speed():
    members = [{"due": 100.0, "speed": 20.0}, {"due": 100.0, "speed": 25.0}, {"due": 100.4, "speed": 30.0}]
    due, period = agreed(members, inner_steps=50)
    assert period == pytest.approx(2.0)       # 50 steps at the median speed, 25/s
    assert due == pytest.approx(102.0)        # the median due + one period
    # the order of the announcements does not matter: every member computes the same
    assert agreed(list(reversed(members)), inner_steps=50) == (due, period)


def test_one_odd_announcement_cannot_move_the_schedule():
    honest = [{"due": 10.0, "speed": 25.0}] * 3
    odd = {"due": 1e12, "speed": 1e9}
    assert agreed([*honest, odd], inner_steps=50) == pytest.approx((12.0, 2.0))


def test_no_usable_announcement_gives_no_schedule():
    assert agreed([{"due": None, "speed": None}], inner_steps=50) is None
    assert agreed([{"due": float("nan"), "speed": 3.0}], inner_steps=50) is None
    assert agreed([{"due": 1.0, "speed": 0.0}], inner_steps=50) is None
    assert agreed([{"due": True, "speed": 3.0}], inner_steps=50) is None  # a bool is not a time


def test_swarm_phase_is_the_one_most_peers_hold():
    records = {"a": {"due": 100.0, "period": 2.0}, "b": {"due": 102.05, "period": 2.0},  # same phase, 1 round apart
               "c": {"due": 101.0, "period": 2.0},                                       # half a period off
               "d": {"inner_step": 3}}                                                   # no schedule yet
    due, period = swarm_phase(records, now=103.0)
    assert period == 2.0
    assert due == pytest.approx(104.0)        # a's 100 carried forward to the first due after now


def test_swarm_phase_tie_goes_to_the_smallest_peer_id():
    records = {"b": {"due": 100.0, "period": 2.0}, "a": {"due": 101.0, "period": 2.0}}
    assert swarm_phase(records, now=100.5) == pytest.approx((101.0, 2.0))
    assert swarm_phase({}, now=0.0) is None


def test_phases_compare_on_the_circle():
    # 99.95 and 100.05 are 0.1 s apart although one is carried to 101.95 and the other to 100.05
    records = {"a": {"due": 99.95, "period": 2.0}, "b": {"due": 100.05, "period": 2.0},
               "c": {"due": 101.0, "period": 2.0}}
    due, _ = swarm_phase(records, now=100.0)
    assert due in (pytest.approx(100.05), pytest.approx(101.95))


def test_clock_through_rounds():
    clock = Clock(inner_steps=50, now=0.0, inner_step=0)
    assert clock.should_enter(now=1.0, inner_step=50) is None  # no schedule before a group formed
    gather = clock.announce(now=2.0, inner_step=50)
    assert gather == {"due": 2.0, "speed": 25.0, "round": 0, "dims": 1, "round_s": None, "period": None,
                      "swarm_period": None}
    clock.after_round([gather, {"due": 2.2, "speed": 25.0}], full=True)
    assert (clock.due, clock.period) == pytest.approx((4.1, 2.0)) and clock.in_phase
    assert not clock.should_enter(now=3.9, inner_step=95)        # 0.2 s early: more than half a step
    assert clock.should_enter(now=4.09, inner_step=100)          # within half a step (0.02 s at 25/s)
    gather = clock.announce(now=4.09, inner_step=100)
    assert gather["due"] == pytest.approx(4.1)                   # the scheduled time, not when we entered
    # a round that formed late does not move the clock: the next due follows from the scheduled one
    clock.after_round([gather, {"due": 4.1, "speed": 24.0}], full=True)
    assert gather["speed"] == pytest.approx(50 / 2.09)           # steps since our last entry, per second
    assert clock.due == pytest.approx(4.1 + 50 / ((gather["speed"] + 24.0) / 2))
    # a partial group: keep its schedule, but look at the swarm's phase at the next progress read
    clock.after_round([{"due": clock.due, "speed": 25.0}] * 2, full=False)
    assert not clock.in_phase


def test_clock_alone_keeps_its_period_and_adopts_the_swarms_phase():
    clock = Clock(inner_steps=50, now=0.0, inner_step=0)
    clock.after_round([{"due": 2.0, "speed": 25.0}] * 2, full=True)
    clock.after_no_group()
    assert clock.due == pytest.approx(6.0) and not clock.in_phase
    others = {"x": {"due": 7.0, "period": 2.0}, "y": {"due": 7.0, "period": 2.0}, "me": clock.record()}
    assert clock.adopt(others, now=6.5)
    assert clock.due == pytest.approx(7.0) and clock.in_phase
    assert not clock.adopt(others, now=6.6)  # already in it


def test_with_a_long_period_a_few_seconds_off_is_out_of_phase():
    """Paced peers (65 s periods): 3.5 s is within 10% of the period but a peer that enters 3.5 s after
    the others misses their group (matchmaking window 2 s); the window bounds what counts as one phase."""
    clock = Clock(inner_steps=50, now=0.0, inner_step=0, window=2.0)
    clock.after_round([{"due": 0.0, "speed": 50 / 65}] * 2, full=False)   # due 65.0, every 65 s
    others = {"x": {"due": 61.5, "period": 65.0}, "y": {"due": 61.5, "period": 65.0}, "me": clock.record()}
    assert clock.adopt(others, now=10.0)
    assert clock.due == pytest.approx(61.5)
    assert not clock.adopt({**others, "x": {"due": 61.9, "period": 65.0}}, now=10.0)  # 0.4 s: one phase
    # without a window (the default) the share of the period decides, as before
    old = Clock(inner_steps=50, now=0.0, inner_step=0)
    old.after_round([{"due": 0.0, "speed": 50 / 65}] * 2, full=False)
    assert not old.adopt(others, now=10.0)
    records = {"a": {"due": 61.5, "period": 65.0}, "b": {"due": 65.0, "period": 65.0},
               "c": {"due": 65.0, "period": 65.0}, "d": {"due": 61.5, "period": 65.0}}
    assert swarm_phase(records, now=10.0) == pytest.approx((61.5, 65.0))      # 3.5 s apart: one phase of 4
    assert swarm_phase({**records, "e": {"due": 65.0, "period": 65.0}}, now=10.0, max_gap=0.5) == pytest.approx(
        (65.0, 65.0))                                                          # two phases: 3 hold 65.0


def test_after_a_partial_group_only_records_published_since_set_the_phase():
    """8 peers, a group of 7 (one missed it): the members' records read right after the round still hold
    the phase they had before it, and counting them moved two members a round's time away from the
    other five (8 peers at a ratio of 5, docs/scale.md). Until a period after the group, only records
    published since it ended count, once they are most of the records."""
    clock = Clock(inner_steps=50, now=0.0, inner_step=0)
    clock.after_round([{"due": 10.0, "speed": 5.0}] * 7, full=False, now=12.0)  # due 20.0, every 10 s
    assert clock.due == pytest.approx(20.0) and not clock.in_phase
    stale = {f"m{i}": {"due": 15.0, "period": 10.0, "time": 11.0} for i in range(6)}  # before the group
    fresh = {"e": {"due": 17.0, "period": 10.0, "time": 12.5}, "me": {**clock.record(), "time": 12.5}}
    assert not clock.adopt({**stale, **fresh}, now=13.0)  # 2 fresh records of 8: wait for more
    assert clock.due == pytest.approx(20.0) and not clock.in_phase
    renewed = {f"m{i}": {"due": 20.0, "period": 10.0, "time": 14.0} for i in range(6)}
    assert not clock.adopt({**renewed, **fresh}, now=14.5)  # most hold ours: nothing moves
    assert clock.in_phase and clock.due == pytest.approx(20.0)
    # a period after the group every record counts again (a publisher's wall clock far behind ours)
    late = Clock(inner_steps=50, now=0.0, inner_step=0)
    late.after_round([{"due": 10.0, "speed": 5.0}] * 7, full=False, now=12.0)
    assert late.adopt({**stale, **fresh}, now=22.5) and late.due == pytest.approx(25.0)
    # a whole group, or no time given (the rule off), reads every record as before
    whole = Clock(inner_steps=50, now=0.0, inner_step=0)
    whole.after_round([{"due": 10.0, "speed": 5.0}] * 7, full=False)
    assert whole.adopt({**stale, **fresh}, now=13.0) and whole.due == pytest.approx(15.0)


def test_a_joiner_without_a_schedule_adopts_the_swarms():
    clock = Clock(inner_steps=50, now=50.0, inner_step=0)
    assert not clock.adopt({"x": {"due": None}}, now=50.0)
    assert clock.adopt({"x": {"due": 40.0, "period": 3.0}}, now=50.0)
    assert clock.due == pytest.approx(52.0) and clock.period == 3.0


def test_the_round_number_and_grid_travel_with_the_schedule():
    """Members leave a group with the highest round + 1 (one that missed rounds catches up) and the
    median proposed grid; a peer alone counts its own rounds; a joiner takes round and grid from the
    phase's records, carried forward."""
    clock = Clock(inner_steps=50, now=0.0, inner_step=0, group_size=4)
    assert clock.announce(now=2.0, inner_step=50, swarm_size=16)["dims"] == 2   # 4 x 4
    members = [{"due": 2.0, "speed": 25.0, "round": r, "dims": d} for r, d in ((5, 2), (7, 2), (7, 9))]
    clock.after_round(members, full=True)
    assert (clock.round, clock.dims) == (8, 2)           # the odd member does not move the grid
    clock.after_no_group()
    assert clock.round == 9 and clock.record()["round"] == 9 and clock.record()["speed"] == 25.0
    clock.should_enter(now=clock.due + 3 * clock.period, inner_step=500)   # 3 periods late: no burst
    assert clock.round == 12
    joiner = Clock(inner_steps=50, now=50.0, inner_step=0, group_size=4)
    assert joiner.adopt({"x": {"due": 40.0, "period": 3.0, "round": 20, "dims": 3}}, now=50.0)
    assert (joiner.due, joiner.round, joiner.dims) == (pytest.approx(52.0), 24, 3)   # 4 periods on
    # in phase already, but our due is the next period's: numbered as the holders number theirs
    assert not joiner.adopt({"x": {"due": 55.0, "period": 3.0, "round": 30, "dims": 3}}, now=50.0)
    assert joiner.round == 29


def test_the_phase_is_numbered_as_most_of_its_holders_number_it():
    """Records of one phase read at different ages (at 256 peers they are read every 64 s): p0's, carried
    forward 5 periods by the period of its time (10 s, now 13 s), numbers the round 13 where the three
    fresh ones say 15. The round is the one most holders give, not the first holder's by peer id (p0's,
    as before); on a tie, the freshest record's."""
    now = 200.0
    old = {"due": 152.7, "period": 10.0, "round": 8, "dims": 3}      # carried to 202.7, round 13
    fresh = {"due": 203.0, "period": 13.0, "round": 15, "dims": 3}
    records = {"p0": old, "p1": fresh, "p2": fresh, "p3": fresh}
    clock = Clock(inner_steps=50, now=now, inner_step=0, group_size=8)
    assert clock.adopt(records, now=now) and clock.due == pytest.approx(202.7)
    assert (clock.round, clock.dims) == (15, 3)
    tie = {"p0": old, "p1": old, "p8": {"due": 190.0, "period": 13.0, "round": 14, "dims": 3}, "p9": fresh}
    clock = Clock(inner_steps=50, now=now, inner_step=0, group_size=8)
    clock.adopt(tie, now=now)
    assert clock.round == 15   # 13 twice (5 periods on), 15 twice (0 and 1 period on)

def test_lines_of_a_grid_keep_the_swarms_period():
    """Two lines of slightly different speeds: each would set its own period and the lines drift apart;
    with the swarm's median speed from the progress records both leave with the same next due time."""
    records = {p: {"speed": s} for p, s in zip("abcdef", (24.0, 25.0, 25.0, 26.0, 25.0, 30.0))}
    dues = []
    for speeds in ((24.0, 24.0), (26.0, 27.0)):
        clock = Clock(inner_steps=50, now=0.0, inner_step=0, group_size=2)
        clock.dims = 2
        clock.observe(records)
        clock.after_round([{"due": 10.0, "speed": v, "round": 3, "dims": 2} for v in speeds], full=False)
        dues.append(clock.due)
    assert dues == pytest.approx([12.0, 12.0])   # 50 steps at the swarm's median speed, 25/s
    alone = Clock(inner_steps=50, now=0.0, inner_step=0)   # one group (no grid): its own members' speeds
    alone.observe(records)
    alone.after_round([{"due": 10.0, "speed": 20.0}] * 2, full=True)
    assert alone.due == pytest.approx(12.5)


def test_a_line_keeps_its_period_while_its_members_views_of_the_swarms_stay_near_it():
    """Two lines whose members read the swarm's period at different times (21.7 and 23.7 s, as 16 real peers
    on 2 cores did: their next rounds came 2 s apart, and then 6) keep the period they held, 22 s, and
    leave with one due time; every member of a line computes the same from the gather whatever its own
    view. A view more than 10% away is taken: the median of the members'."""
    def line(views, held=22.0, own=None):
        clock = Clock(inner_steps=30, now=0.0, inner_step=0, group_size=4)
        clock.dims, clock.swarm_period = 2, own
        clock.after_round([{"due": 40.0, "speed": 1.0, "round": 3, "dims": 2, "period": held, "swarm_period": v}
                           for v in views], full=False)
        return clock.due, clock.period
    assert line([21.7, 21.7, 21.9, 22.0]) == line([23.7, 23.6, 22.5, 23.7]) == (pytest.approx(62.0), 22.0)
    assert line([23.7, 23.6, 22.5, 23.7], own=21.0) == line([23.7, 23.6, 22.5, 23.7], own=30.0)
    assert line([26.0, 26.0, 25.0, 27.0]) == (pytest.approx(66.0), 26.0)   # 18% slower: the swarm's median view
    assert line([26.0, 26.0, 25.0, 27.0], held=None) == (pytest.approx(66.0), 26.0)  # no period held yet
    assert line([None] * 4, own=25.0) == (pytest.approx(65.0), 25.0)       # older peers: our own view


def test_a_due_time_missed_by_over_half_a_period_moves_to_the_nearest():
    clock = Clock(inner_steps=50, now=0.0, inner_step=0)
    clock.after_round([{"due": 2.0, "speed": 25.0}] * 2, full=True)   # due 4.0, every 2.0 s
    assert clock.should_enter(now=4.9, inner_step=120)                # 0.45 period late: still this round's
    clock.due = 4.0
    assert not clock.should_enter(now=5.2, inner_step=130)            # 0.6 late: the next one, at 6.0
    assert clock.due == pytest.approx(6.0)
    assert not clock.should_enter(now=11.2, inner_step=260)           # a long freeze: 12.0, no burst
    assert clock.due == pytest.approx(12.0)


def test_the_period_is_never_shorter_than_a_round():
    """Fast compute, slow rounds: 8 steps in 1.5 s, rounds of 2 s. A period of 1.5 s leaves every round
    running at its next due time, and the swarm split into halves on alternating due times (8 peers on a
    grid, a ratio of 0.7); the period stretches to 1.25 rounds, and the contribution holds more steps."""
    fast = [{"due": 10.0, "speed": 8 / 1.5, "round_s": t} for t in (1.9, 2.0, 2.4)]
    due, period = agreed(fast, inner_steps=8)
    assert period == pytest.approx(1.25 * 2.0) and due == pytest.approx(10.0 + period)
    # rounds short beside H steps: the speed alone, as before
    assert agreed([{**m, "round_s": 0.3} for m in fast], inner_steps=8)[1] == pytest.approx(1.5)
    # one member's odd round time cannot stretch it (the median), and no round time yet: the speed alone
    odd = [*fast[:2], {"due": 10.0, "speed": 8 / 1.5, "round_s": 1e9}, {"due": 10.0, "speed": 8 / 1.5, "round_s": 0.1}]
    assert agreed(odd, inner_steps=8)[1] == pytest.approx(1.25 * 1.95)
    assert agreed([{"due": 10.0, "speed": 8 / 1.5, "round_s": None}] * 2, inner_steps=8)[1] == pytest.approx(1.5)
    # a clock announces its last round's time, and the swarm's period (records) takes the same floor
    clock = Clock(inner_steps=8, now=0.0, inner_step=0, group_size=4)
    clock.after_round(fast, full=True, round_s=2.1)
    assert clock.announce(now=clock.due, inner_step=16)["round_s"] == 2.1 and clock.record()["round_s"] == 2.1
    clock.observe({p: {"speed": 8 / 1.5, "round_s": 2.0} for p in "abc"})
    assert clock.swarm_period == pytest.approx(2.5)


def test_a_step_of_the_wall_clock_does_not_set_the_period():
    """The wall clock of every peer of a run stepped 16 s forward (an 8-peer run on this machine): the
    speeds measured on it read 5x too slow and the next round came 36 s later, H = 30 at 8 steps/s.
    Durations come from the monotonic clock; due times stay on the wall clock."""
    clock = Clock(inner_steps=30, now=1000.0, inner_step=0, mono=0.0)
    gather = clock.announce(now=1004.0, inner_step=30, mono=4.0)
    assert gather["speed"] == pytest.approx(7.5)
    clock.after_round([gather] * 2, full=True)
    assert (clock.due, clock.period) == pytest.approx((1008.0, 4.0))
    # 16 s forward on the wall clock, 4 s on the monotonic one
    assert clock.should_enter(now=1024.0, inner_step=60, mono=8.0)   # 4 periods on: the nearest due, no burst
    assert clock.due == pytest.approx(1024.0)
    gather = clock.announce(now=1024.0, inner_step=60, mono=8.0)
    assert gather["speed"] == pytest.approx(7.5)                       # not 30 steps / 20 s
    clock.after_round([gather] * 2, full=True)
    assert clock.period == pytest.approx(4.0)
    # and 16 s back: the due time comes back by whole periods, nobody waits out the step
    assert not clock.should_enter(now=1010.0, inner_step=70, mono=9.5)
    assert clock.due == pytest.approx(1012.0) and clock.period == pytest.approx(4.0)
    assert clock.should_enter(now=1012.0, inner_step=90, mono=11.5)


def test_a_round_just_after_a_late_one_measures_the_speed_over_more_steps():
    """A round entered late lands and the next due time comes 2 s later: 4 steps and the round's own
    overhead would set the swarm's period; the speed spans at least H/2 steps of our earlier entries."""
    clock = Clock(inner_steps=30, now=0.0, inner_step=0)
    clock.announce(now=4.0, inner_step=30)
    gather = clock.announce(now=6.0, inner_step=34)
    assert gather["speed"] == pytest.approx(34 / 6.0)                 # since the start, not 4 steps / 2 s
    gather = clock.announce(now=10.0, inner_step=64)
    assert gather["speed"] == pytest.approx(30 / 4.0)                 # 30 >= 15 steps since the last entry


# ------------------------------------------------------------------ 4 real peers on a schedule

def _full_rounds(outer: list, size: int) -> float:
    return sum(r["group_size"] >= size for r in outer) / max(1, len(outer))


@pytest.mark.timeout(240)
def test_four_peers_meet_on_the_schedule_and_survivors_keep_it_after_a_kill(tmp_path, corpus):
    """4 real peers that start together: once the first group formed, rounds hold all 4 and a
    contribution holds about inner_steps steps (not inner_steps plus the wait for the group); after a
    SIGKILL the 3 survivors keep meeting on the same clock. The benchmark measures the targets
    (docs/benchmarks.md); here the bounds leave room for a loaded CI machine. The peers are paced
    (--slowdown, a sleep): unpaced, 4 tiny peers on 2 cores take ~1 s for inner_steps steps, no longer
    than a round itself, so a contribution holds the round's time, not the schedule's (CI: 38 for 30)."""
    import signal

    from p2pdiloco.localswarm import LocalSwarm
    from tests.conftest import TINY

    H, names = 30, "abcd"
    with LocalSwarm(tmp_path, config=TINY, extra_args=["--data", str(corpus), "--inner-steps", str(H),
                                                       "--target-group-size", "4", "--wait-for-peers", "4",
                                                       "--eval-every", "4", "--slowdown", "4"]) as swarm:
        swarm.start_bootstrap("boot")
        for name in names:
            swarm.start(name, join="boot")
        # 8 rounds counted: with 6, one peer that missed two due times on a loaded CI machine failed the bound
        # (4 of 6 whole, CI of 3a72dde); by hand, a peer frozen 4 s past a due time missed one round, not two
        swarm.wait_for(lambda: all(len(swarm.events(n, "outer")) >= 9 for n in names), timeout=120,
                       what="9 outer steps on every peer")
        tokens_per_step = 16 * 64
        seen = {n: ([r["group_size"] for r in swarm.events(n, "outer")],
                    [r["reason"][:60] for r in swarm.events(n, "round_failed")]) for n in names}
        for name in names:
            outer = swarm.events(name, "outer")[1:]  # the first round forms before there is a schedule
            assert _full_rounds(outer, 4) >= 0.75, seen
            steps = sorted(r["tokens"] / tokens_per_step for r in outer if r["group_size"] == 4)
            # without the schedule the median was H plus the wait for the group: ~1.4-1.6x H
            assert 0.8 * H <= steps[len(steps) // 2] <= 1.25 * H, steps
        swarm.signal("d", signal.SIGKILL)
        killed_at = {n: len(swarm.events(n, "outer")) for n in "abc"}
        swarm.wait_for(lambda: all(sum(r["group_size"] == 3 for r in swarm.events(n, "outer")[killed_at[n]:]) >= 3
                                   for n in "abc"), timeout=90, what="3 rounds of the 3 survivors after the kill")
        for name in "abc":
            after = swarm.events(name, "outer")[killed_at[name]:]
            # the survivors stay in one phase: no round of 2 among 3 live peers once d's record expired
            assert all(r["group_size"] == 3 for r in after if r.get("swarm_size") == 3), after


@pytest.mark.timeout(240)
def test_a_step_of_every_peers_wall_clock_does_not_stall_the_rounds(tmp_path, corpus):
    """3 real peers; after 3 rounds every peer's wall clock steps 16 s forward (its DHT and averager
    processes too; cli._test_clock_step), as a suspended machine's does. A speed measured on the wall
    clock read 5x too slow and set a period 5-16x too long: 8 peers on this machine once made no round
    for 45 s and then contributed 489 steps of H = 30 (docs/scale.md, "A step of the wall clock")."""
    from p2pdiloco.localswarm import LocalSwarm
    from tests.conftest import TINY

    H, names, step_file = 30, "abc", tmp_path / "clock-step"
    with LocalSwarm(tmp_path, config=TINY, env={"P2PDILOCO_TEST_CLOCK_STEP": f"{step_file}:16"},
                    extra_args=["--data", str(corpus), "--inner-steps", str(H), "--target-group-size", "3",
                                "--wait-for-peers", "3", "--eval-every", "4", "--slowdown", "4"]) as swarm:
        swarm.start_bootstrap("boot")
        for name in names:
            swarm.start(name, join="boot")
        swarm.wait_for(lambda: all(len(swarm.events(n, "outer")) >= 3 for n in names), timeout=120,
                       what="3 outer steps on every peer")
        before = {n: len(swarm.events(n, "outer")) for n in names}
        step_file.touch()
        swarm.wait_for(lambda: all(len(swarm.events(n, "outer")) >= before[n] + 5 for n in names), timeout=90,
                       what="5 more outer steps on every peer")
        for name in names:
            after = swarm.events(name, "outer")[before[name]:before[name] + 5]
            steps = [r["tokens"] / (16 * 64) for r in after]
            assert max(steps) <= 2.5 * H, steps
