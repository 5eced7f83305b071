"""The members' check that every reducer returned the aggregate of what it was sent (robust.py's
fixed-point condition), piece by piece of the round's buffer.

A piece is one reducer's part, cut where a merge round's segments meet (the reducer runs its rule
on each segment's piece separately): [pseudo-gradient | anchor | momentum]. Per piece, every member
that applies the round publishes its distance to the average (first record, with a nonce), then its
projected term of the fixed-point condition (second record); averaging.RoundRunner moves the
records through the DHT, this module does the arithmetic.

    >>> check = RoundCheck(report, policy, aggregation, sent=[pseudo_grad, anchor, momentum],
    ...                    buffer=round_buffer, merge_size=n, me=peer_id, members=ids)
    >>> evidence = check.evidence()              # {"nonce", "dist"}: the first record
    >>> terms = check.terms(records)             # the second record, from every member's first
    >>> result = check.verdict(ids, all_terms)   # {"ok", "bad", "stat", ...}
"""

from __future__ import annotations

import math
import secrets
from typing import Optional

import torch

from p2pdiloco import robust


class RoundCheck:
    def __init__(self, report, policy, aggregation: str, *, sent: list, buffer: torch.Tensor, merge_size: int,
                 me: str, members: list):
        self.report, self.policy, self.aggregation = report, policy, aggregation
        self.sent, self.buffer, self.me, self.members = sent, buffer, me, members
        n = merge_size if report.merged else 0
        self.pieces: list[tuple] = []  # (offset, length, reducer, segment)
        offset = 0
        for length, reducer in report.layout:
            start, end = offset, offset + length
            while start < end:
                segment = start // n if n else 0
                stop = min(end, (segment + 1) * n) if n else end
                self.pieces.append((start, stop - start, reducer, segment))
                start = stop
            offset = end
        self.n = n

    def weights(self, index: int) -> list:
        """Member `index`'s weight in each segment: its capped announced weight for the pseudo-gradient,
        its merge vote for the anchor and momentum (0 if it sent none)."""
        w = self.policy.weights[index]
        if not self.report.merged:
            return [w]
        scale, vote = self.policy.merge_scales[index], self.policy.merge_votes[index]
        anchor_w = vote if scale > 0 and w > 0 else 0.0
        return [w, anchor_w, anchor_w]

    def _own(self, offset: int, length: int, segment: int) -> torch.Tensor:
        """What we sent, as it is. Where fp16 transport rounded it on its way to a reducer, our copy of
        the average carries the same rounding (hivemind adds the reducer's delta, average minus our
        rounded part, to our own values), so own - average is what the reducer saw."""
        start = offset - segment * self.n
        return self.sent[segment][start:start + length]

    def _average(self, offset: int, length: int) -> torch.Tensor:
        return self.buffer[offset:offset + length]

    def evidence(self, applying: bool) -> dict:
        """Our first record: a nonce (drawn now, after every reducer answered us) and, if we apply the
        round, our distance to the average in each piece."""
        record = {"nonce": secrets.randbits(62)}
        if applying:
            record["dist"] = [float((self._own(o, k, s) - self._average(o, k)).norm()) for o, k, _, s in self.pieces]
        return record

    def terms(self, records: dict) -> list:
        """Our second record: per piece, our term of the fixed-point condition on each check direction,
        tau from every applying member's distances (robust.tau_of) and directions seeded by every
        member's nonce but the reducer's."""
        nonces = {p: r.get("nonce") for p, r in records.items() if isinstance(r, dict)}
        self.dists = {p: r["dist"] for p, r in records.items() if p in self.members and isinstance(r, dict)
                      and isinstance(r.get("dist"), list) and len(r["dist"]) == len(self.pieces)}
        weights = {p: self.weights(self.members.index(p)) for p in self.dists}
        mine = weights[self.me]
        out, self.floors = [], []
        for k, (offset, length, reducer, segment) in enumerate(self.pieces):
            tau = math.inf
            if self.aggregation == "centered_clip":
                tau = robust.tau_of([d[k] for p, d in self.dists.items() if weights[p][segment] > 0])
            z = robust.directions(robust.check_seed(self.report.group_id, k, nonces, self.members[reducer]), length)
            average = self._average(offset, length)
            out.append(robust.fixed_point_terms(self._own(offset, length, segment), average, mine[segment], tau, z))
            self.floors.append(robust.check_floor(average, sum(w[segment] for w in weights.values())))
        return out

    def checkers(self) -> list:
        """The members whose terms we wait for: those that apply the round (published distances)."""
        return list(self.dists)

    def verdict(self, found: dict) -> dict:
        """found: checker -> its terms. A piece whose terms do not sum to about zero names its reducer."""
        bad, worst, failed = set(), 0.0, []
        for k, (_, length, reducer, segment) in enumerate(self.pieces):
            column = [terms if all(math.isfinite(t) for t in terms) else [0.0] * len(terms)
                      for terms in (found[p][k] for p in self.checkers())]
            stat = robust.check_statistic(column, self.floors[k])
            worst = max(worst, stat)
            if stat > robust.CHECK_THRESHOLD:
                bad.add(self.members[reducer])
                if len(failed) < 3:  # the evidence, for the log: each checker's first projected term
                    failed.append({"piece": k, "segment": segment, "values": length, "stat": round(stat, 3),
                                   "terms": {p[-6:]: round(column[i][0], 6) for i, p in enumerate(self.checkers())}})
        return {"ok": not bad, "bad": sorted(bad), "members": self.members, "stat": worst,
                "pieces": len(self.pieces), "merged": self.report.merged, **({"failed": failed} if failed else {})}

    def well_formed(self, value: Optional[list]) -> bool:
        return isinstance(value, list) and len(value) == len(self.pieces)
