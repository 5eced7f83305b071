"""Disjoint data across peers without a coordinator: shards claimed through the DHT.

The sample space is every (shard, window) of the prepared train split; each shard's windows are
read in an order seeded by (run seed, shard, epoch). Before reading a shard a peer claims it: one
record per shard under the run's key for the epoch, `{peer, token, cursor, lease_until, done}`
(HMAC'd like every record of a run with a secret). A peer searches from a stable hash of its peer
id, skipping shards that are done or held by a live lease; it renews its lease with its cursor
every log interval. A lease not renewed (a dead peer) runs out, and the next peer to look resumes
that shard at its published cursor. A peer restarted from its checkpoint takes its shard back
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

    >>> claims = ShardClaims(dht, cfg, shards=[(index, n_windows), ...], peer_id=peer_id)
    >>> windows = claims.take(batch_size)       # [(shard index, window index)], claiming as needed
    >>> claims.renew()                          # every log interval: lease and cursor
    >>> claims.position()                       # {"epoch", "shard", "cursor"}, for metrics and status
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from typing import Callable, Optional

import numpy as np
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

RECORD_TTL = 7 * 24 * 3600.0  # how long the DHT keeps a shard's record (its cursor, done): a week
MAX_SEARCHES = 64  # epochs a search for a free shard reads at most (it ends sooner unless peers >> shards)


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


class ShardClaims:
    """This peer's place in the global sample space, claimed shard by shard through the DHT."""

    def __init__(self, dht, cfg, *, shards: list[tuple[int, int]], peer_id: str, on_range: Callable = None,
                 lease_s: Optional[float] = None, start_epoch: int = 0):
        self.dht = dht
        self.cfg = cfg
        self.windows = {index: n for index, n in shards}  # shard index -> windows, the shards we can read
        self.n_shards = len(shards)
        self.order = sorted(self.windows)
        digest = hashlib.sha256(peer_id.encode()).digest()
        start = int.from_bytes(digest[:8], "little") % max(len(self.order), 1)
        self.order = self.order[start:] + self.order[:start]  # our search starts at a stable hash of our id
        self.peer_id = peer_id
        self.lease_s = lease_s or max(15.0, 3 * cfg.log_interval)
        self.on_range = on_range or (lambda **_: None)
        self.epoch = self.floor = start_epoch  # floor: the oldest epoch that may still have free shards
        self.shard: Optional[int] = None
        self.cursor = 0
        self.logged = 0  # cursor at the last range reported
        self.token = secrets.token_hex(8)
        self._perm: Optional[np.ndarray] = None

    # --- reading --------------------------------------------------------------------------

    def take(self, n: int) -> list[tuple[int, int]]:
        """The next n (shard, window) pairs of this peer's order, claiming shards as it goes."""
        out: list[tuple[int, int]] = []
        while len(out) < n:
            if self.shard is None or self.cursor >= self.windows[self.shard]:
                self._next_shard()
            m = min(n - len(out), self.windows[self.shard] - self.cursor)
            out.extend((self.shard, int(k)) for k in self._perm[self.cursor:self.cursor + m])
            self.cursor += m
        return out

    def position(self) -> dict:
        return {"epoch": self.epoch, "shard": self.shard, "cursor": self.cursor, "shards": self.n_shards}

    # --- the DHT --------------------------------------------------------------------------

    def _read(self, epoch: int) -> dict[int, dict]:
        return parse_claims(self.dht.get(claims_key(self.cfg.dht_prefix, epoch), latest=True))

    def _store(self, shard: int, *, cursor: int, lease_until: float, done: bool = False) -> None:
        record = {"peer": self.peer_id, "token": self.token, "cursor": int(cursor), "lease_until": lease_until,
                  "done": done}
        self.dht.store(claims_key(self.cfg.dht_prefix, self.epoch), subkey=str(shard), value=record,
                       expiration_time=get_dht_time() + RECORD_TTL)

    def _take_shard(self, shard: int, cursor: int) -> None:
        self.shard, self.cursor, self.logged = shard, cursor, cursor
        self._perm = window_order(self.cfg.seed, shard, self.epoch, self.windows[shard])

    def _report(self) -> None:
        if self.shard is not None and self.cursor > self.logged:
            self.on_range(epoch=self.epoch, shard=self.shard, start=self.logged, end=self.cursor)
            self.logged = self.cursor

    def _next_shard(self) -> None:
        """Finish the current shard (if read to its end) and claim the next free one, from the
        oldest epoch not yet done."""
        if self.shard is not None:
            self._report()
            if self.cursor >= self.windows[self.shard]:
                self._store(self.shard, cursor=self.cursor, lease_until=0.0, done=True)
            self.shard = None
        epoch = self.floor
        for _ in range(MAX_SEARCHES):
            claims = self._read(epoch)
            now = get_dht_time()
            if all(claims.get(s, {}).get("done") for s in self.order):
                if epoch == self.floor:
                    self.floor += 1  # this epoch is over: nobody needs to look at it again
                epoch += 1
                continue
            self.epoch = epoch
            # our own unfinished shards first: a peer restarted from its checkpoint (same token)
            # goes on where it was reading when it stopped
            mine = [s for s in self.order if claims.get(s, {}).get("token") == self.token]
            for shard in mine + [s for s in self.order if s not in mine]:
                rec = claims.get(shard, {})
                if rec.get("done") or (rec.get("lease_until", 0) > now and rec.get("token") != self.token):
                    continue
                cursor = min(int(rec.get("cursor", 0)), self.windows[shard])
                if cursor < self.windows[shard] and self._claim(shard, cursor):
                    return
            epoch += 1  # nothing free here: our own search goes on in the next epoch
        self.epoch = epoch  # a swarm far larger than its data: read rather than stall
        self._claim(self.order[0], 0, check=False)

    def _claim(self, shard: int, cursor: int, check: bool = True) -> bool:
        self._store(shard, cursor=cursor, lease_until=get_dht_time() + self.lease_s)
        if check:
            rec = self._read(self.epoch).get(shard, {})
            if rec.get("token") != self.token:
                return False
        self._take_shard(shard, cursor)
        logger.info(f"claimed shard {shard} of epoch {self.epoch} at window {cursor}")
        return True

    def renew(self) -> None:
        """Every log interval: report the range read, then renew the lease with the cursor, unless
        another live peer holds the shard now (a race we lost): then give it up."""
        if self.shard is None:
            return
        self._report()
        rec = self._read(self.epoch).get(self.shard, {})
        if rec.get("token") not in (None, self.token) and rec.get("lease_until", 0) > get_dht_time():
            logger.info(f"shard {self.shard} of epoch {self.epoch} is held by {rec.get('peer')}: giving it up")
            self.shard = None
            return
        self._store(self.shard, cursor=self.cursor, lease_until=get_dht_time() + self.lease_s)

    def release(self) -> None:
        """At a clean stop: the shard is free at once, at our cursor."""
        if self.shard is None:
            return
        self._report()
        self._store(self.shard, cursor=self.cursor, lease_until=0.0, done=self.cursor >= self.windows[self.shard])

    # --- checkpoints ----------------------------------------------------------------------

    def state(self) -> dict:
        return {"epoch": self.epoch, "shard": self.shard, "cursor": self.cursor, "token": self.token}

    def restore(self, state: dict) -> None:
        """After a restart from a checkpoint: its epoch and claim token, so that the shard we were
        reading (its lease still ours, or run out) is taken back at the later of the checkpointed
        and published cursors."""
        try:
            epoch, shard = int(state["epoch"]), state.get("shard")
            cursor, token = int(state.get("cursor", 0)), str(state["token"])
        except (KeyError, TypeError, ValueError):
            return
        self.token, self.epoch, self.floor = token, epoch, epoch
        if shard is None or shard not in self.windows:
            return
        rec = self._read(epoch).get(shard, {})
        if rec.get("done") or (rec.get("token") != token and rec.get("lease_until", 0) > get_dht_time()):
            return
        cursor = max(cursor, int(rec.get("cursor", 0)))
        if cursor < self.windows[shard] and self._claim(shard, cursor):
            logger.info(f"resumed shard {shard} of epoch {epoch} at window {cursor}")
