"""Peers that keep attacking: what each round says about its members, and local bans.

After every round that formed, each member judges the others from what it saw itself: a sender
our reducer excluded (non-finite, over the norm bound) or clipped hard (CenteredClip scaled its
pseudo-gradient's deviation below robust.HARD_CLIP: more than twice the group's median distance
away) or, in a merge round, its anchor or momentum clipped hard, or a reducer whose part failed
the members' check. (An honest minority's anchor in a merge round is clipped to ~0 by design: the
robust merge takes the anchor most members hold. Not counting that broke the ban of a diverged
attacker in the suite's byzantine test, so it still counts; docs/security.md.) A peer judged bad in
most of its last rounds with us (`BAN_BAD` of the last `BAN_WINDOW`) is banned for `ban_time`
seconds: our averager refuses its join requests and does not ask to join its groups (a local
decision, no vote; the others decide for themselves). An honest peer far from the others now and
then is clipped too, which is why one round never bans.

    >>> suspects = Suspects(ban_time=600.0)
    >>> suspects.judge(outcome, metrics, averager)   # after every round, applied or not
"""

from __future__ import annotations

import collections
import logging
import time

from p2pdiloco import robust

logger = logging.getLogger(__name__)

BAN_WINDOW = 8  # rounds with a peer that its verdict looks back on
BAN_BAD = 5     # of those, judged bad: banned


class Suspects:
    def __init__(self, *, ban_time: float, peer_id: str = ""):
        self.ban_time, self.peer_id = ban_time, peer_id
        self.history: dict[str, collections.deque] = {}
        self.banned_until: dict[str, float] = {}
        self.reasons: dict[str, str] = {}  # why each peer was banned
        self._sent: frozenset = frozenset()  # the banned set our averager knows

    def judge(self, outcome, metrics, averager=None, *, outer_step: int = 0) -> None:
        """Log what the round showed of its members (bad_contribution, reducer_check) and ban a peer
        that keeps attacking."""
        report = outcome.report
        if report is None:
            return
        for peer, why in report.rejected.items():
            metrics.log("bad_contribution", sender=peer, reason=why, outer_step=outer_step)
        for peer, factor in report.clipped.items():
            if factor < robust.HARD_CLIP:
                metrics.log("bad_contribution", sender=peer, outer_step=outer_step,
                            reason=f"clipped to {factor:.2f} of its distance from the group's robust average")
        for peer, factor in report.merge_clipped.items():
            if factor < robust.HARD_CLIP:
                metrics.log("bad_contribution", sender=peer, outer_step=outer_step,
                            reason=f"its anchor or momentum clipped to {factor:.2f} (a merge round)")
        if outcome.check is not None:
            metrics.log("reducer_check", outer_step=outer_step, **outcome.check)
        bad_reducers = set(outcome.check["bad"]) if outcome.check else set()
        now = time.monotonic()
        for peer in outcome.members:
            if peer == self.peer_id:
                continue
            reasons = []
            if peer in report.rejected:
                reasons.append("excluded")
            if min(report.clipped.get(peer, 1.0), report.merge_clipped.get(peer, 1.0)) < robust.HARD_CLIP:
                reasons.append("clipped hard")
            if peer in bad_reducers:
                reasons.append("its reducer failed the check")
            history = self.history.setdefault(peer, collections.deque(maxlen=BAN_WINDOW))
            history.append(", ".join(reasons))
            bad = sum(bool(r) for r in history)
            if self.ban_time > 0 and bad >= BAN_BAD and self.banned_until.get(peer, 0.0) <= now:
                why = collections.Counter(r for r in history if r).most_common(1)[0][0]
                self.banned_until[peer] = now + self.ban_time
                self.reasons[peer] = why
                history.clear()
                logger.warning(f"banned peer {peer[-8:]} for {self.ban_time:.0f}s: {why} in {bad} of its last "
                               f"{BAN_WINDOW} rounds with us")
                metrics.log("banned", sender=peer, reason=why, rounds=bad, seconds=self.ban_time,
                            outer_step=outer_step)
        self.sync(averager)

    def banned(self) -> frozenset:
        now = time.monotonic()
        return frozenset(peer for peer, until in self.banned_until.items() if until > now)

    def record(self) -> dict:
        """Our current bans for the status record (`p2pdiloco status` lists the peers banned)."""
        return {peer: self.reasons.get(peer, "") for peer in sorted(self.banned())}

    def sync(self, averager) -> None:
        """Tell our averager when the banned set changed (a ban began or ended)."""
        current = self.banned()
        if averager is not None and current != self._sent:
            averager.set_banned(sorted(current))
            self._sent = current
