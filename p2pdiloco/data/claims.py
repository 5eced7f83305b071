"""Disjoint data across peers without a coordinator: shards claimed through the DHT.

The sample space is every (shard, window) of the prepared train split; each shard's windows are
read in an order seeded by (run seed, shard, epoch). Before reading a shard a peer claims it: one
record per shard under the run's key for the epoch, `{peer, token, cursor, lease_until, done}`
(HMAC'd like every record of a run with a secret). A peer searches the shards in an order given by
a stable hash of its peer id, skipping shards that are done or held by a live lease; it renews
its lease with its cursor every log interval. A lease not renewed (a dead peer) runs out, and the
next peer to look resumes that shard at its published cursor. A peer restarted from its checkpoint takes its shard back
(the claim's token is in the checkpoint) at the later of its checkpointed and published cursors.

An epoch ends when every shard is done. Every search starts at the oldest epoch not known to be
done (a joiner: the oldest epoch among the live peers' progress records), so shards freed by dead
peers are found; a peer that finds no free shard there goes on in the next epoch, so a swarm of
more peers than free shards never waits. The next epoch reads every shard in a new order.

Races: a peer stores its claim and reads it back at once; of two stores to one shard the later
wins on every DHT node (hivemind keeps the later expiration), and the peer that sees the other's
token looks further. A store that lands after the read-back is caught by the next renewal, which
reads before it writes: a peer that finds its shard held by another live lease gives it up, so
the loser of a race trains at most one log interval of windows twice. (A pause before the
read-back would catch more races at once, but it is a data wait at every shard switch.)

A peer reads `width` shards at once (`shards_per_peer`), one window from each in turn: with one,
its inner steps between two rounds would all come from one region of the corpus (one play of
Shakespeare, one crawl date), which is what a shard of an unshuffled corpus is.

A peer that does not hold every shard (fetch.py, a ShardSource given as `source`) claims a shard
only once `source.ready(shard)` says it is here (fetching it first if a live peer holds it): a
shard nobody holds stays free and is claimed later. With fewer ready shards than `width`, it reads
fewer at once and looks again every lease; with none at all, it waits (stop_event ends the wait:
`take` raises Stopped).

    >>> claims = ShardClaims(dht, cfg, shards=[(index, n_windows), ...], peer_id=peer_id, width=4)
    >>> windows = claims.take(batch_size)       # [(shard index, window index)], claiming as needed
    >>> claims.renew()                          # every log interval: leases and cursors
    >>> claims.position()                       # {"epoch", "shard", "cursor", "held"}, for metrics and status
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

RECORD_TTL = 7 * 24 * 3600.0  # how long the DHT keeps a shard's record (its cursor, done): a week
MAX_SEARCHES = 64  # epochs a search for a free shard reads at most (it ends sooner unless peers >> shards)


class Stopped(Exception):
    """The peer is stopping while it waited for a shard to read."""


def claims_key(prefix: str, epoch: int) -> str:
    return f"{prefix}_data_e{epoch}"


def window_order(seed: int, shard: int, epoch: int, n_windows: int) -> np.ndarray:
    """The order in which a shard's windows are read in an epoch: the same on every peer."""
    return np.random.default_rng([seed, shard, epoch]).permutation(n_windows)


def parse_claims(found) -> dict[int, dict]:
    """shard index -> record, from a DHT get of an epoch's claims key."""
    if found is None or not isinstance(found.value, dict):
        return {}
    out = {}
    for k, v in found.value.items():
        try:
            if isinstance(v.value, dict):
                out[int(k)] = v.value
        except (TypeError, ValueError):
            continue
    return out


def coverage(claims: dict[int, dict], n_shards: int, now: Optional[float] = None) -> dict:
    """Shards done / claimed (a live lease) / free, for `status`."""
    now = get_dht_time() if now is None else now
    done = sum(1 for r in claims.values() if r.get("done"))
    claimed = sum(1 for r in claims.values() if not r.get("done") and r.get("lease_until", 0) > now)
    return {"done": done, "claimed": claimed, "free": max(0, n_shards - done - claimed)}


@dataclass
class Slot:
    """One claimed shard being read: its epoch, where we are in its window order, and where the
    last reported range ended."""

    epoch: int
    shard: int
    cursor: int
    logged: int
    perm: np.ndarray


class ShardClaims:
    """This peer's place in the global sample space: up to `width` claimed shards read at once,
    their windows interleaved, each replaced by the next free shard when read to its end."""

    def __init__(self, dht, cfg, *, shards: list[tuple[int, int]], peer_id: str, on_range: Callable = None,
                 lease_s: Optional[float] = None, start_epoch: int = 0, width: int = 1, source=None,
                 stop_event=None):
        self.dht = dht
        self.cfg = cfg
        self.windows = {index: n for index, n in shards}  # shard index -> windows, the shards we can read
        self.n_shards = len(shards)
        # our search order: shards sorted by a stable hash of (our id, shard), so that peers start
        # apart and the shards a peer reads at once lie all over the corpus, not side by side
        self.order = sorted(self.windows, key=lambda s: hashlib.sha256(f"{peer_id}/{s}".encode()).digest())
        self.peer_id = peer_id
        self.lease_s = lease_s or max(15.0, 3 * cfg.log_interval)
        self.on_range = on_range or (lambda **_: None)
        self.floor = start_epoch  # the oldest epoch that may still have free shards
        self.width = max(1, min(width, len(self.order)))
        self.slots: list[Slot] = []
        self.turn = 0  # the slot the next window comes from
        self.token = secrets.token_hex(8)
        self.source = source  # fetch.py's ShardSource, or None: every shard is here
        self.stop_event = stop_event
        self._fill_at = 0.0  # when to look again for shards to fill empty slots
        # take() runs in the data feed's thread, renew() in the records thread, release() and restore() in
        # the training thread: one at a time. position() and state() only read (a copy of the slots).
        self._lock = threading.RLock()

    # --- reading --------------------------------------------------------------------------

    def take(self, n: int) -> list[tuple[int, int]]:
        """The next n (shard, window) pairs of this peer's order, one slot after the other,
        claiming shards as slots empty."""
        with self._lock:
            return self._take(n)

    def _take(self, n: int) -> list[tuple[int, int]]:
        if len(self.slots) < self.width and (not self.slots or time.monotonic() >= self._fill_at):
            self._fill()
        out: list[tuple[int, int]] = []
        while len(out) < n:
            i = self.turn % len(self.slots)
            self.turn += 1
            slot = self.slots[i]
            if slot.cursor >= self.windows[slot.shard]:
                self._finish(slot)
                new = self._next_slot(wait=len(self.slots) == 1)
                if new is None:  # no other shard ready: read the others
                    self.slots.pop(i)
                    continue
                slot = self.slots[i] = new
            out.append((slot.shard, int(slot.perm[slot.cursor])))
            slot.cursor += 1
        return out

    def _fill(self) -> None:
        while len(self.slots) < self.width:
            slot = self._next_slot(wait=not self.slots)
            if slot is None:  # fewer ready shards than slots: look again in a lease
                self._fill_at = time.monotonic() + self.lease_s
                return
            self.slots.append(slot)

    def position(self) -> dict:
        """Where the first slot reads (epoch, shard, cursor) and every slot's [epoch, shard, cursor]."""
        slots = list(self.slots)
        first = slots[0] if slots else None
        return {"epoch": first.epoch if first else self.floor, "shard": first.shard if first else None,
                "cursor": first.cursor if first else 0, "shards": self.n_shards,
                "held": [[s.epoch, s.shard, s.cursor] for s in slots]}

    # --- the DHT --------------------------------------------------------------------------

    def _read(self, epoch: int) -> dict[int, dict]:
        """An epoch's records; {} when the DHT does not answer within request_timeout (the train
        loop never waits longer: a claim made blind is checked again at the next renewal)."""
        future = self.dht.get(claims_key(self.cfg.dht_prefix, epoch), latest=True, return_future=True)
        try:
            return parse_claims(future.result(timeout=self.cfg.request_timeout))
        except Exception as e:  # TimeoutError, or the DHT shutting down under us
            future.cancel()
            logger.warning(f"no answer about epoch {epoch}'s shard claims: {e!r}")
            return {}

    def _store(self, epoch: int, shard: int, *, cursor: int, lease_until: float, done: bool = False) -> None:
        record = {"peer": self.peer_id, "token": self.token, "cursor": int(cursor), "lease_until": lease_until,
                  "done": done}
        future = self.dht.store(claims_key(self.cfg.dht_prefix, epoch), subkey=str(shard), value=record,
                                expiration_time=get_dht_time() + RECORD_TTL, return_future=True)
        try:
            future.result(timeout=self.cfg.request_timeout)
        except Exception as e:  # the record may still land; the next renewal stores it again
            future.cancel()
            logger.warning(f"storing the claim of shard {shard} (epoch {epoch}) did not finish: {e!r}")

    def _slot(self, epoch: int, shard: int, cursor: int) -> Slot:
        return Slot(epoch, shard, cursor, cursor, window_order(self.cfg.seed, shard, epoch, self.windows[shard]))

    def _report(self, slot: Slot, end: Optional[int] = None) -> None:
        """Report the range read since the last report, up to `end` (default: the cursor)."""
        end = slot.cursor if end is None else end
        if end > slot.logged:
            self.on_range(epoch=slot.epoch, shard=slot.shard, start=slot.logged, end=end)
            slot.logged = end

    def _publish(self, slot: Slot, *, lease_until: float, done: bool = False) -> None:
        """Store the slot's claim at its cursor, then report the range read up to it: a peer killed
        between the two leaves a report behind its published cursor, never ahead (CI: a peer killed
        right after a report, before its store landed, left the windows between to be read again)."""
        cursor = slot.cursor
        self._store(slot.epoch, slot.shard, cursor=cursor, lease_until=lease_until, done=done)
        self._report(slot, cursor)

    def _finish(self, slot: Slot) -> None:
        self._publish(slot, lease_until=0.0, done=True)

    def _held(self) -> set[tuple[int, int]]:
        return {(s.epoch, s.shard) for s in self.slots}

    def _next_slot(self, wait: bool = True) -> Optional[Slot]:
        """Claim the next free shard that is ready, from the oldest epoch not yet done. None when
        none is ready, unless `wait`: then look again until one is (or stop_event)."""
        waited = False
        while True:
            slot = self._search()
            if slot is not None or not wait:
                return slot
            if not waited:
                logger.warning("no free shard is here or held by a live peer: waiting for one")
                waited = True
            if self.stop_event is not None and self.stop_event.wait(2.0):
                raise Stopped()
            if self.stop_event is None:
                time.sleep(2.0)

    def ready(self, shard: int) -> bool:
        """The shard is here (fetched first if a live peer holds it)."""
        return self.source is None or self.source.ready(shard)

    def _search(self) -> Optional[Slot]:
        if self.source is not None and not any(self.source.available(s) for s in self.order):
            return None  # nothing here and nobody holding anything: no epoch has a shard for us
        epoch = self.floor
        for _ in range(MAX_SEARCHES):
            claims = self._read(epoch)
            now = get_dht_time()
            if all(claims.get(s, {}).get("done") for s in self.order):
                if epoch == self.floor:
                    self.floor += 1  # this epoch is over: nobody needs to look at it again
                epoch += 1
                continue
            # our own unfinished shards first: a peer restarted from its checkpoint (same token)
            # goes on where it was reading when it stopped
            mine = [s for s in self.order if claims.get(s, {}).get("token") == self.token]
            for shard in mine + [s for s in self.order if s not in mine]:
                rec = claims.get(shard, {})
                if (epoch, shard) in self._held() or rec.get("done") or (
                        rec.get("lease_until", 0) > now and rec.get("token") != self.token):
                    continue
                cursor = min(int(rec.get("cursor", 0)), self.windows[shard])
                if cursor >= self.windows[shard]:
                    continue
                t0 = time.monotonic()
                if self.source is not None and not self.source.here(shard) and self.source.available(shard):
                    self._hold_during(self.cfg.state_timeout)  # a fetch may outlast our leases
                if not self.ready(shard):  # not here and no live peer holds it: claimed again later
                    continue
                if time.monotonic() - t0 > 1.0:  # fetched meanwhile: is it still free, and where?
                    rec = self._read(epoch).get(shard, {})
                    if rec.get("done") or (rec.get("lease_until", 0) > get_dht_time()
                                           and rec.get("token") != self.token):
                        continue
                    cursor = min(int(rec.get("cursor", 0)), self.windows[shard])
                if cursor < self.windows[shard] and self._claim(epoch, shard, cursor):
                    return self._slot(epoch, shard, cursor)
            epoch += 1  # nothing free here: our own search goes on in the next epoch
        # a swarm far larger than its data: read rather than stall
        here = next((s for s in self.order if self.ready(s)), None)
        if here is None:
            return None
        self._claim(epoch, here, 0, check=False)
        return self._slot(epoch, here, 0)

    def _claim(self, epoch: int, shard: int, cursor: int, check: bool = True) -> bool:
        self._store(epoch, shard, cursor=cursor, lease_until=get_dht_time() + self.lease_s)
        if check and self._read(epoch).get(shard, {}).get("token") != self.token:
            return False
        logger.info(f"claimed shard {shard} of epoch {epoch} at window {cursor}")
        return True

    def renew(self) -> None:
        """Every log interval, for each slot: report the range read, then renew the lease with the
        cursor, unless another live peer holds the shard now (a race we lost): then let it go."""
        with self._lock:
            self._renew()

    def _renew(self) -> None:
        by_epoch = {e: self._read(e) for e in {s.epoch for s in self.slots}}
        for i, slot in enumerate(list(self.slots)):
            rec = by_epoch[slot.epoch].get(slot.shard, {})
            if rec.get("token") not in (None, self.token) and rec.get("lease_until", 0) > get_dht_time():
                logger.info(f"shard {slot.shard} of epoch {slot.epoch} is held by {rec.get('peer')}: giving it up")
                self._report(slot)  # what we read; the holder's record stays
                self.slots.remove(slot)  # take() claims another
                continue
            self._publish(slot, lease_until=get_dht_time() + self.lease_s)

    def _hold_during(self, seconds: float) -> None:
        """Before a fetch that blocks the reading (up to `seconds`): the shards we read stay ours
        through it (a slow uplink takes longer than a lease), at our cursors."""
        for slot in self.slots:
            if slot.cursor < self.windows[slot.shard]:  # a finished one is stored done: leave it
                self._publish(slot, lease_until=get_dht_time() + self.lease_s + seconds)

    def release(self) -> None:
        """At a clean stop: our shards are free at once, at our cursors."""
        with self._lock:
            self._release()

    def _release(self) -> None:
        for slot in self.slots:
            self._publish(slot, lease_until=0.0, done=slot.cursor >= self.windows[slot.shard])

    # --- checkpoints ----------------------------------------------------------------------

    def state(self) -> dict:
        return {"floor": self.floor, "token": self.token,
                "slots": [[s.epoch, s.shard, s.cursor] for s in list(self.slots)]}

    def restore(self, state: dict) -> None:
        """After a restart from a checkpoint: its claim token, so that the shards we were reading
        (their leases still ours, or run out) are taken back at the later of the checkpointed and
        published cursors."""
        with self._lock:
            self._restore(state)

    def _restore(self, state: dict) -> None:
        try:
            token, floor = str(state["token"]), int(state["floor"])
            held = [(int(e), int(s), int(c)) for e, s, c in state.get("slots", [])]
        except (KeyError, TypeError, ValueError):
            return
        self.token, self.floor = token, min(floor, *(e for e, _, _ in held)) if held else floor
        for epoch, shard, cursor in held:
            if shard not in self.windows or len(self.slots) >= self.width or not self.ready(shard):
                continue
            rec = self._read(epoch).get(shard, {})
            if rec.get("done") or (rec.get("token") != token and rec.get("lease_until", 0) > get_dht_time()):
                continue
            published = int(rec.get("cursor", 0))
            cursor = max(cursor, published)
            if cursor < self.windows[shard] and self._claim(epoch, shard, cursor):
                slot = self._slot(epoch, shard, cursor)
                # a checkpoint newer than our last renewal: its model was trained on the windows
                # between the two, which the next range reported says
                slot.logged = min(published, cursor)
                self.slots.append(slot)
                logger.info(f"resumed shard {shard} of epoch {epoch} at window {cursor}")
