"""Rounds on a schedule: every peer enters matchmaking at the moment the swarm agreed on, with no
coordinator.

The swarm's rounds are due on a clock. Round k+1 is due one `period` after round k, and the period
is the time a peer of the group's median speed takes for inner_steps steps:

    period = inner_steps / median(members' speeds)        # speeds in inner steps per second
    period = max(period, 1.25 x median(members' last round times))   # a round outlasting H steps
    due    = median(members' announced due times) + period

Every member of a formed group computes both from the same announcements (each member's `due`
and `speed` travel in its matchmaking gather), so all of them leave the round with the same next
due time and enter the next round together: the group forms at once, instead of when its last
member happens to arrive, and a contribution holds `speed x period` inner steps (H for a peer of
median speed; fewer for a slower one, whose pseudo-gradient is weighted by its tokens) instead of
H plus the wait for the group (docs/benchmarks.md §0: 67-79 steps at H=50). The clock does not
slip: the next due time follows from the scheduled one, not from when the group formed, and a peer
whose previous round is still in flight when it is due enters as soon as that round lands.

A peer out of phase (a joiner, a peer woken from a freeze, a member of a group that did not hold
every live peer, a peer alone in its window) takes the swarm's phase from the progress records,
where every peer publishes its next due time and period: the phase that most live peers hold (on
a tie, the one of the smallest peer id), so that two halves of a swarm that drifted apart fall back
into one.

hivemind.Optimizer schedules the same way from the swarm's published progress
(`hivemind/optim/progress_tracker.py`: peers publish samples and speed, estimate when the swarm's
next epoch is due and start matchmaking ahead of it). Due times are wall-clock (`time.time()`),
like hivemind's `get_dht_time()`: peers' clocks must agree to a fraction of the period (NTP does).
Durations are not: a peer's speed is measured on its monotonic clock (`mono`), so that a step of the
wall clock (NTP, a suspended machine: 16 s forward on every peer of a run here) neither reads as a
slow swarm nor sets a period 10x too long; and over at least half of H steps, so that a round entered
just after a late one does not set the period from a handful of steps and the round's overhead.

    >>> clock = Clock(inner_steps=50, now=0.0, inner_step=0)
    >>> clock.should_enter(now=1.0, inner_step=50) is None  # no schedule yet: the trainer counts steps
    True
    >>> gather = clock.announce(now=1.0, inner_step=50)   # {"due": 1.0, "speed": 50.0}
    >>> clock.after_round([gather, {"due": 1.0, "speed": 50.0}], full=True)
    >>> clock.due, clock.period
    (2.0, 1.0)
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Optional

from p2pdiloco import grid

SPEED_SPAN = 0.5  # the speed is measured over at least this share of inner_steps (our earlier entries)
SPEED_MARKS = 8   # entries remembered for that
PHASE_TOLERANCE = 0.1  # due times closer than this share of the period are one phase ...
# ... and closer than this share of the matchmaking window: peers further apart than that enter too far
# apart to meet in one window. Paced peers (a period of 65 s, docs/benchmarks.md) were 3.5 s out of
# phase, inside 10% of the period, and missed every round
WINDOW_TOLERANCE = 0.25
PERIOD_HYSTERESIS = 0.1  # a line keeps its period until the swarm's, as its members read it, is this far off
# (a contribution of the median peer then stays within 10% of inner_steps)
ROUND_MARGIN = 1.25  # the period is at least this many rounds' times (the median member's last round)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**62


def agreed(members: list[dict], *, inner_steps: int) -> Optional[tuple[float, float]]:
    """(next due time, period) from a formed group's announcements; None if nobody announced a
    usable due time and speed. Medians: one member's odd announcement cannot move the group."""
    dues = [float(m["due"]) for m in members if _number(m.get("due"))]
    speeds = [float(m["speed"]) for m in members if _number(m.get("speed")) and m["speed"] > 0]
    if not dues or not speeds:
        return None
    period = _period(inner_steps, speeds, [m.get("round_s") for m in members])
    return statistics.median(dues) + period, period


def _period(inner_steps: int, speeds: list, round_times: list) -> float:
    """inner_steps at the median speed, but no shorter than ROUND_MARGIN x the median round's time: where a
    round takes longer than H steps (fast compute, a slow network), every member's round would still run at
    its next due time, and the swarm would split into halves on alternating due times. The contribution then
    holds more than H steps, the steps made while the last round was in flight."""
    period = inner_steps / statistics.median(speeds)
    times = [float(t) for t in round_times if _number(t) and t > 0]
    return max(period, ROUND_MARGIN * statistics.median(times)) if times else period


def swarm_phase(records: dict, *, now: float, tolerance: float = PHASE_TOLERANCE,
                max_gap: float = math.inf) -> Optional[tuple[float, float]]:
    """(next due time >= now, period) of the phase that most live peers hold, from their progress
    records (peer id -> record with `due` and `period`); None if no record has one. Each record's
    due time is carried forward by whole periods to the first one after now (records are up to a
    log interval old); two peers hold the same phase when those times are within tolerance x period
    (and max_gap seconds) of each other, on the circle of one period."""
    found = _phase(records, now=now, tolerance=tolerance, max_gap=max_gap)
    return None if found is None else found[:2]


def _phase(records: dict, *, now: float, tolerance: float, max_gap: float):
    """swarm_phase's (due, period), with the grid dimensions of the record chosen and the round number
    most of the phase's holders give (each carried forward by the same whole periods as its due time)."""
    phases = []
    for peer, record in sorted(records.items()):
        due, period = record.get("due"), record.get("period")
        if not (_number(due) and _number(period) and period > 0):
            continue
        ahead = max(0, math.ceil((now - due) / period))
        round_, dims = record.get("round"), record.get("dims")
        round_ = round_ + ahead if _integer(round_) else None
        dims = dims if _integer(dims) and 1 <= dims <= grid.MAX_DIMS else None
        phases.append((peer, due + ahead * period, period, round_, dims, ahead))
    if not phases:
        return None

    def holding(phase) -> list:
        _, due, period, _, _, _ = phase
        out = []
        for other in phases:
            gap = (other[1] - due) % period
            if min(gap, period - gap) <= min(tolerance * period, max_gap):
                out.append(other)
        return out

    # most holders; on a tie, the smallest peer id (phases are sorted by peer id, max keeps the first)
    chosen = max(phases, key=lambda phase: len(holding(phase)))
    _, due, period, round_, dims, _ = chosen
    # the round number most of its holders give it, each carried to this due time; on a tie the freshest
    # record's (carried forward by the fewest periods). One record's number is not enough: a record read 64 s
    # late (256 peers) and carried forward by the period of its time, 10 s against 13 s now, numbered the
    # round 2 off, and a peer that took it met another dimension of the grid than its line did
    votes = collections.Counter()
    freshest = {}
    for _, other_due, _, other_round, _, ahead in holding(chosen):
        if other_round is not None:
            number = other_round + round((due - other_due) / period)
            votes[number] += 1
            freshest[number] = min(freshest.get(number, ahead), ahead)
    if votes:
        round_ = max(votes, key=lambda number: (votes[number], -freshest[number]))
    return due, period, round_, dims


class Clock:
    """One peer's view of the schedule: when to enter matchmaking next.

    The trainer asks `should_enter` after every inner step, puts `announce`'s fields into its round's
    gather, and tells the clock how each round ended (`after_round` for a formed group,
    `after_no_group` otherwise). `adopt` takes the swarm's phase from the progress records when this
    peer may be out of it (`in_phase` False). Before the first formed group there is no schedule.
    """

    def __init__(self, *, inner_steps: int, now: float, inner_step: int, window: float = math.inf,
                 group_size: int = 0, mono: Optional[float] = None):
        self.inner_steps = inner_steps  # H: a peer of the group's median speed contributes this many steps
        self.group_size = group_size    # > 1: past this many live peers, groups are lines of a grid (grid.py)
        self.round = 0                  # the swarm's round number: which dimension of the grid groups peers
        self.swarm_period: Optional[float] = None  # inner_steps at the swarm's median speed (progress records)
        self.last_speed: Optional[float] = None    # our speed at our last entry, for our progress record
        self.round_s: Optional[float] = None       # seconds our last formed round took, entry to end (announced)
        self.dims = 1                   # the grid's dimensions, agreed like the due time
        self.max_gap = WINDOW_TOLERANCE * window  # seconds: entries further apart than this may not meet
        self.due: Optional[float] = None      # wall-clock time of our next entry
        self.period: Optional[float] = None   # seconds between the swarm's rounds
        self.in_phase = False                 # False: take the swarm's phase at the next progress read
        # wall-clock end of our last partial group of one dimension: until a period after it, the phase is read
        # only from records published since (`adopt`)
        self.fresh_after: Optional[float] = None
        # (monotonic time, inner step) of our last entries (and the start): the speed is measured from them
        self._marks = collections.deque([(now if mono is None else mono, inner_step)], maxlen=SPEED_MARKS)

    def should_enter(self, *, now: float, inner_step: int, mono: Optional[float] = None) -> Optional[bool]:
        """Enter matchmaking now? At the due time (half a step early: the step boundary nearest to
        it). None without a schedule: the trainer enters every inner_steps steps, as without one.
        A due time missed by more than half a period (a round that ran long, a freeze) moves to the
        nearest one: rounds that catch up in a burst would each apply a whole outer step to a
        few steps' pseudo-gradient. A due time more than a period and a half ahead (the wall clock
        stepped back) moves back by whole periods: nobody waits out the step."""
        if self.due is None:
            return None
        missed = round((now - self.due) / self.period) if self.period else 0
        if missed >= 1:  # late by over half a period (a round that ran long, a freeze): the nearest due, no burst
            self.due += missed * self.period
            self.round += missed
        elif self.period and self.due - now > 1.5 * self.period:
            self.due -= math.floor((self.due - now) / self.period - 0.5) * self.period
        speed = self.speed(inner_step=inner_step, mono=now if mono is None else mono)
        return now >= self.due - (0.5 / speed if speed else 0.0)

    def speed(self, *, inner_step: int, mono: float) -> Optional[float]:
        """Our inner steps per second (everything included: rounds, evaluations) since our last entry,
        or since an earlier one when fewer than SPEED_SPAN x inner_steps steps lie behind it; mono is
        the monotonic clock the entries were marked with."""
        span = max(1, math.ceil(SPEED_SPAN * self.inner_steps))
        t0, step0 = self._marks[0]  # the oldest, unless a later one has enough steps behind it
        for t, step in reversed(self._marks):
            if inner_step - step >= span:
                t0, step0 = t, step
                break
        return (inner_step - step0) / (mono - t0) if inner_step > step0 and mono > t0 else None

    def announce(self, *, now: float, inner_step: int, swarm_size: int = 1, mono: Optional[float] = None) -> dict:
        """What our round's gather carries: the due time we entered for (now, without a schedule),
        our speed (`speed`), the round number and the grid's dimensions we propose for the swarm we
        see. Marks this entry."""
        mono = now if mono is None else mono
        speed = self.speed(inner_step=inner_step, mono=mono)
        self.last_speed = speed if speed is not None else self.last_speed
        fields = {"due": self.due if self.due is not None else now, "speed": speed, "round": self.round,
                  "dims": grid.dims_for(swarm_size, self.group_size), "round_s": self.round_s,
                  "period": self.period, "swarm_period": self.swarm_period}
        self._marks.append((mono, inner_step))
        return fields

    def after_round(self, members: list[dict], *, full: bool, round_s: Optional[float] = None,
                    now: Optional[float] = None) -> None:
        """A group formed (applied or not): the next due time every member computes alike. A group
        that did not hold every live peer may have left some out of phase: check the swarm's.
        round_s: how long the round took us (announced at our next entry); now: the wall-clock time."""
        schedule = agreed(members, inner_steps=self.inner_steps)
        self.round_s = round_s if _number(round_s) and round_s > 0 else self.round_s
        proposed = [m["dims"] for m in members if _integer(m.get("dims")) and 1 <= m["dims"] <= grid.MAX_DIMS]
        self.dims = statistics.median_low(proposed) if proposed else self.dims  # one odd member cannot move it
        if schedule is not None:
            self.due, self.period = schedule
            period = self._line_period(members) if self.dims > 1 else None
            if period is not None:
                self.due, self.period = self.due - self.period + period, period
        # the highest round number: a member that missed rounds catches up (it only picks the grid's dimension)
        rounds = [m["round"] for m in members if _integer(m.get("round"))]
        self.round = max(rounds) + 1 if rounds else self.round + 1
        self.in_phase = full and schedule is not None
        # a partial group of one dimension: its members' records from before it still hold the phase they had
        # before, which the group just replaced (a grid's lines take theirs from records read rarely anyway)
        self.fresh_after = now if not full and self.dims <= 1 and _number(now) else None

    def _line_period(self, members: list[dict]) -> Optional[float]:
        """A line's period, the same on every member and, as far as can be, on every line. A line of a grid
        holds a few peers: a period from its own speeds would set every line on a clock of its own. The
        swarm's (inner_steps at the median speed in the progress records) is each member's view, read at its
        own time, and 16 real peers on 2 cores whose lines each took one (21.7 and 23.7 s) entered the next
        round up to 6 s apart, against a 2 s window. So: the median of the members' views, and the period
        they held before (their median) unless that view is more than PERIOD_HYSTERESIS away from it."""
        views = [float(m["swarm_period"]) for m in members if _number(m.get("swarm_period")) and m["swarm_period"] > 0]
        held = [float(m["period"]) for m in members if _number(m.get("period")) and m["period"] > 0]
        view = statistics.median(views) if views else self.swarm_period
        if view is None:
            return None
        before = statistics.median(held) if held else None
        if before is not None and abs(view - before) <= PERIOD_HYSTERESIS * before:
            return before
        return view

    def after_no_group(self) -> None:
        """Nobody met us: keep our own clock for now, and look at the swarm's phase."""
        if self.due is not None and self.period is not None:
            self.due += self.period
        self.round += 1
        self.in_phase = False

    def observe(self, records: dict) -> None:
        """The swarm's period from its progress records: inner_steps at the median of the live peers' speeds
        (no shorter than ROUND_MARGIN x their median round's time)."""
        speeds = [r["speed"] for r in records.values() if _number(r.get("speed")) and r["speed"] > 0]
        if len(speeds) >= 2:
            self.swarm_period = _period(self.inner_steps, speeds, [r.get("round_s") for r in records.values()])

    def adopt(self, records: dict, *, now: float) -> bool:
        """Take the phase that most live peers hold (their progress records); True if ours moved.

        For a period after a partial group, only the records published since it ended count, and only
        once they are most of the records: a member's record from before the group holds the phase it
        left, and a peer that counted those (8 peers at a ratio of 5, in groups of 7 and 1) took a phase
        a round's time away from its group's and split the next round."""
        if self.fresh_after is not None and self.period is not None and now < self.fresh_after + self.period:
            fresh = {peer: r for peer, r in records.items() if _number(r.get("time")) and r["time"] >= self.fresh_after}
            if 2 * len(fresh) <= len(records):
                return False
            records = fresh
        phase = _phase(records, now=now, tolerance=PHASE_TOLERANCE, max_gap=self.max_gap)
        if phase is None:
            return False
        due, period, round_, dims = phase
        self.in_phase = True
        self.dims = dims or self.dims  # the grid's position too: its shape, and the round number below
        if self.due is not None and self.period is not None:
            gap = (due - self.due) % period
            if min(gap, period - gap) <= min(PHASE_TOLERANCE * period, self.max_gap):  # already in it
                if round_ is not None:  # numbered as the phase's holders number it (its due may be periods away)
                    self.round = round_ - round((due - self.due) / period)
                return False
        self.due, self.period = due, period
        self.round = round_ if round_ is not None else self.round
        return True

    def record(self) -> dict:
        """Our next due time and period, for the progress record (others adopt the phase from it)."""
        return {"due": self.due, "period": self.period, "round": self.round, "dims": self.dims,
                "speed": self.last_speed, "round_s": self.round_s}
