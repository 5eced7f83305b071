"""The peer's swarm records, kept by a background thread: the training thread makes no DHT call.

    >>> records = SwarmRecords(dht, cfg, claims=claims, shard_source=source, swarm_size=lambda: n)
    >>> records.publish(record)          # every log interval: our latest record (returns at once)
    >>> records.ask_read()               # after a freeze: read the others' records now
    >>> found = records.take_read()      # the others' progress records, once per read (or None)
    >>> records.close()

Each wake-up the thread does what a log interval asks of the DHT: our progress record (as often as
we read the others', spaced out in a big swarm so that the bytes per peer stay flat), our status
record (every STATUS_EVERY s, or at once when a ban or an address changed), the run's config
announcement (every minute), the data claims' renewal and the shards we serve, and a read of the
others' progress records. What it read is applied by the training thread (the schedule, the grid
and the staleness check are the training thread's own), a dictionary handed over, not a DHT call.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Optional

from p2pdiloco import swarm

logger = logging.getLogger(__name__)

CONFIG_EVERY = 60.0  # seconds between announcements of the run's config
REJOIN_SPAN = 600.0  # seconds: the peers a read showed this recently are pinged when a read shows nobody else


class SwarmRecords:
    def __init__(self, dht, cfg, *, claims=None, shard_source=None, swarm_size: Callable[[], int]):
        self.dht, self.cfg = dht, cfg
        self.claims, self.shard_source = claims, shard_source
        self.swarm_size = swarm_size
        self._lock = threading.Condition()
        self._record: Optional[dict] = None  # to publish
        self._read_asked = False
        self._found: Optional[dict] = None  # the last read, not yet taken
        self._closed = False
        self._announced = self._started = time.monotonic()
        self._published_at = self._status_published_at = self._read_at = -math.inf
        self._status_news = None  # what our last status record said that status must show at once
        # whom we ping when a read shows nobody else (swarm.rejoin): the others our reads showed and the initial
        # peers (peer id -> when, monotonic; forgotten after REJOIN_SPAN), the initial peers with their addresses
        self._initial: dict[str, list[str]] = {}
        for maddr in cfg.initial_peers:
            peer = swarm.peer_id_of(maddr)
            if peer is not None:
                self._initial.setdefault(peer, []).append(maddr)
        self._seen: dict[str, float] = dict.fromkeys(self._initial, time.monotonic())
        self._cut_off = False  # our last read showed nobody else, though we knew of others
        self._thread = threading.Thread(target=self._loop, name="swarm-records", daemon=True)
        self._thread.start()

    def publish(self, record: dict) -> None:
        with self._lock:
            self._record = record
            self._lock.notify()

    def leave(self, record: dict) -> None:
        """Our last records, saying that we stop (swarm.publish_leaving), in the caller's thread: up to 2 s."""
        self.close()
        swarm.publish_leaving(self.dht, self.cfg, record, every=swarm.progress_read_every(self.cfg, self.swarm_size()))

    def ask_read(self) -> None:
        with self._lock:
            self._read_asked = True
            self._lock.notify()

    def take_read(self) -> Optional[dict]:
        with self._lock:
            found, self._found = self._found, None
            return found

    def close(self, timeout: float = 2.0) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while self._record is None and not self._read_asked and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                record, self._record = self._record, None
                asked, self._read_asked = self._read_asked, False
            try:
                if record is not None:
                    self._keep_up(record)
                self._read(force=asked)
            except Exception as e:  # a slow or failed DHT call delays a record, never the training
                logger.debug(f"swarm records: {e!r}")

    def _keep_up(self, record: dict) -> None:
        cfg, now = self.cfg, time.monotonic()
        if now - self._announced > CONFIG_EVERY:
            swarm.announce_config(self.dht, cfg)
            self._announced = now
        if self.claims is not None:
            self.claims.renew()
            self.shard_source.announce()
        every = self._every()
        if time.monotonic() - self._published_at >= 0.9 * every or "stores" in swarm.LEGACY_DHT:
            swarm.publish_progress(self.dht, cfg, record, every=every)
            self._published_at = time.monotonic()
            news = (record.get("banned"), record["maddrs"], record["reachability"])
            if (self._published_at - self._status_published_at >= 0.9 * max(every, swarm.STATUS_EVERY)
                    or news != self._status_news):
                swarm.publish_status(self.dht, cfg, record, every=max(every, swarm.STATUS_EVERY))
                self._status_published_at, self._status_news = self._published_at, news

    def _read(self, *, force: bool) -> None:
        now = time.monotonic()  # a big swarm's records are read less often
        if not force and now - self._read_at < 0.9 * self._every():
            return
        self._read_at = now
        found = swarm.read_progress(self.dht, self.cfg, timeout=10.0)
        with self._lock:
            self._found = found
        self._keep_in_touch(found)

    def _every(self) -> float:
        """Seconds between our stores of our progress record and our reads of everyone's (a new peer's grow
        with its age: swarm.progress_read_every)."""
        return swarm.progress_read_every(self.cfg, self.swarm_size(), age=time.monotonic() - self._started)

    def _keep_in_touch(self, found: dict) -> None:
        """A read that shows nobody else while we knew of others: our DHT may have lost them all (a
        freeze: swarm.rejoin says how), so ping the peers we knew and the initial peers back in."""
        own, now = str(self.dht.peer_id), time.monotonic()
        others = [peer for peer, record in found.items() if peer != own and not record.get("left")]
        self._seen.update((peer, now) for peer in others)
        self._seen = {peer: t for peer, t in self._seen.items()  # a peer that stopped cleanly said so
                      if now - t <= REJOIN_SPAN and not found.get(peer, {}).get("left")}
        if others:
            if self._cut_off:
                logger.info(f"back in touch with the swarm: {len(others)} other peer(s) in the DHT")
            self._cut_off = False
            return
        peers = {peer: self._initial.get(peer, []) for peer in self._seen}
        if not peers:  # the first peer of a swarm, or the last one: alone
            return
        if not self._cut_off:
            logger.info(f"the DHT shows no other peer (after a freeze or a network cut?): pinging the "
                        f"{len(peers)} we knew")
        self._cut_off = True
        swarm.rejoin(self.dht, peers)
