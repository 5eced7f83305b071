"""In the swarm: this peer's addresses, and the small records peers publish in the DHT (progress
for the schedule, status for `status`, the run's config fingerprint, each peer's run). bootstrap.py
starts the DHT.

    >>> dht = bootstrap.start_dht(cfg)        # retries dead initial peers; SwarmError says why none worked
    >>> write_maddrs(dht, "a.txt")
    >>> check_run_config(dht, cfg)            # SwarmError if the run uses another model config
    >>> publish_progress(dht, cfg, {"outer_step": 3, ...})
    >>> records = read_progress(dht, cfg)     # peer id -> latest record, dead peers expire
    >>> publish_status(dht, cfg, {"outer_step": 3, "maddrs": [...], ...}, every=30.0)

Any hivemind DHT node (e.g. `hivemind-dht`) can serve as an initial peer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from pathlib import Path
from typing import Optional

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.secret import public_key, verifier

logger = logging.getLogger(__name__)


class SwarmError(RuntimeError):
    """The swarm cannot be joined as asked; the CLI reports it on one line and exits 2."""


def is_loopback(maddr: str) -> bool:
    return maddr.startswith("/ip4/127.") or maddr.startswith("/ip6/::1/")


def peer_id_of(maddr: str) -> Optional[str]:
    """The peer id a multiaddr names (the last /p2p/ part: a relayed address names the relay first)."""
    try:
        ids = [value for proto, value in Multiaddr(maddr).items() if proto.name == "p2p"]
    except Exception:  # the vendored multiaddr raises several unrelated types
        return None
    return str(ids[-1]) if ids else None


def learned_peers(dht: hivemind.DHT, cfg, timeout: float = 5.0) -> list[str]:
    """Multiaddrs of the other live peers of the run, from their status records: a DHT that
    restarts can bootstrap through them when the initial peers are gone."""
    try:
        records = read_status(dht, cfg, timeout=timeout)
    except Exception as e:  # a slow read: the initial peers are all we have then
        logger.debug(f"progress read failed: {e!r}")
        return []
    own = str(dht.peer_id)
    return list(dict.fromkeys(a for peer, r in records.items() if peer != own
                              for a in r.get("maddrs") or [] if isinstance(a, str) and "/p2p/" in a))


def rejoin(dht: hivemind.DHT, peers: dict[str, list[str]], timeout: float = 10.0) -> int:
    """Ping these peers (peer id -> multiaddrs to dial, or [] for the addresses p2pd already knows)
    into our DHT's routing table, and us into theirs; how many answered. hivemind drops a peer from
    its routing table when a request to it goes unanswered: the others drop a frozen peer (a laptop
    that sleeps, SIGSTOP) during the freeze, the sleeper drops them when its requests of before the
    freeze time out, and nothing makes either side ask the other again. The DHT is then split for
    good: the sleeper reads only its own records, and its groups never meet the others' (seen in 3 of
    4 runs of the suite's 12 s SIGSTOP, docs/scale.md)."""
    try:
        return dht.run_coroutine(functools.partial(_ping_peers, peers=peers), return_future=True).result(timeout)
    except Exception as e:  # the DHT is slow or gone: the next read tries again
        logger.debug(f"rejoin failed: {e!r}")
        return 0


async def _ping_peers(_dht, node, *, peers: dict[str, list[str]]) -> int:
    async def ping(peer: str, maddrs: list[str]) -> bool:
        peer_id = PeerID.from_base58(peer)
        if maddrs:
            try:
                await node.p2p._client.connect(peer_id, [Multiaddr(m) for m in maddrs])
            except Exception as e:  # the ping below may still reach it through addresses p2pd knows
                logger.debug(f"could not dial {peer}: {e!r}")
        return await node.protocol.call_ping(peer_id) is not None

    answers = await asyncio.gather(*(ping(p, m) for p, m in peers.items()), return_exceptions=True)
    return sum(answer is True for answer in answers)


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """This peer's multiaddrs as others can dial them, loopback first."""
    addrs = [str(a) for a in dht.get_visible_maddrs()]
    return sorted(set(addrs), key=lambda a: (not is_loopback(a), a))


def write_maddrs(dht: hivemind.DHT, path: str) -> None:
    """Write the multiaddrs one per line, atomically (readers never see a half-written file)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    Path(tmp).write_text("".join(f"{a}\n" for a in visible_maddrs(dht)))
    os.replace(tmp, path)


def _run_key(cfg) -> str:
    return f"p2pdiloco_{cfg.run_id}_configs"


PEERS_KEY = "p2pdiloco_peers"  # peer id -> {"run_id", "fingerprint"}, for peers of runs without a secret


def check_run_config(dht: hivemind.DHT, cfg) -> None:
    """Refuse to join a run whose live peers hold another secret or train another model config,
    or (with no peer of our run in sight) through an initial peer of another run; then announce
    ours (and, with a secret, this peer's member record)."""
    found = dht.get(public_key(cfg.run_id), latest=True)
    theirs = set()
    if found is not None and isinstance(found.value, dict):
        theirs = {v.value for v in found.value.values() if isinstance(v.value, str)}
    if theirs and not cfg.run_secret:
        raise SwarmError(f"run {cfg.run_id!r} is protected: pass its --run-secret (or P2PDILOCO_RUN_SECRET)")
    if cfg.run_secret:
        mine = verifier(cfg.run_secret, cfg.run_id)
        if theirs and mine not in theirs:
            raise SwarmError(f"wrong run secret for run {cfg.run_id!r}: its peers refuse this one")
    found = dht.get(_run_key(cfg), latest=True)
    fingerprints = set()
    if found is not None and isinstance(found.value, dict):
        fingerprints = {v.value for v in found.value.values() if isinstance(v.value, str)}
        if fingerprints and cfg.fingerprint() not in fingerprints:
            raise SwarmError(
                f"run {cfg.run_id!r} is training another model config or wire format, or on other prepared "
                f"data (fingerprint {', '.join(sorted(fingerprints))}, ours {cfg.fingerprint()}): use the swarm's "
                "preset and --data, or another --run-id")
    if not theirs and not fingerprints and cfg.initial_peers and not cfg.run_secret:
        _check_other_run(dht, cfg)
    announce_config(dht, cfg)


def _check_other_run(dht: hivemind.DHT, cfg) -> None:
    """No peer of our run is in sight: if an initial peer trains another run, the user most likely
    typed the wrong --run-id (a stock hivemind DHT node publishes no record and passes)."""
    found = dht.get(PEERS_KEY, latest=True)
    if found is None or not isinstance(found.value, dict):
        return
    records = {str(k): v.value for k, v in found.value.items() if isinstance(v.value, dict)}
    for addr in cfg.initial_peers:
        record = records.get(peer_id_of(addr) or "")
        other = record.get("run_id") if record else None
        if isinstance(other, str) and other != cfg.run_id:
            raise SwarmError(f"initial peer {addr} is training run {other!r}, not {cfg.run_id!r}: use --run-id "
                             f"{other} (or that run's preset), or join through a peer of run {cfg.run_id!r}")


def announce_config(dht: hivemind.DHT, cfg) -> None:
    """Publish (for 120 s; republished with progress) what joiners check: our model fingerprint,
    our run (without a secret: a secured run's id stays private), and with a secret the run's
    public verifier and our member record."""
    expiration = get_dht_time() + 120
    peer = str(dht.peer_id)
    dht.store(_run_key(cfg), subkey=peer, value=cfg.fingerprint(), expiration_time=expiration, return_future=True)
    if not cfg.run_secret:
        dht.store(PEERS_KEY, subkey=peer, value={"run_id": cfg.run_id, "fingerprint": cfg.fingerprint()},
                  expiration_time=expiration, return_future=True)
    else:
        dht.store(public_key(cfg.run_id), subkey=peer, value=verifier(cfg.run_secret, cfg.run_id),
                  expiration_time=expiration, return_future=True)
        dht.store(member_key(cfg), subkey=peer, value=True, expiration_time=expiration)


def member_key(cfg) -> str:
    return f"{cfg.dht_prefix}_members"


# Benchmark-only (scale.py swarm --legacy-dht): put back hivemind's DHT cache ("cache") or a progress
# store every log interval whatever the swarm's size ("stores") or Kademlia's beam of 20 ("beam", bootstrap.py),
# or the whole record in the progress key and no status key ("records"), to measure what each change saved
LEGACY_DHT = set(filter(None, os.environ.get("P2PDILOCO_LEGACY_DHT", "").split(",")))


# What the peers read from each other's progress records, every few seconds: the schedule (due, period,
# round, dims, speed, round_s), the grid (cell), the staleness check (outer_step), dynamic inner steps
# (tokens_per_s); and the numbers `monitor` plots, so that its curves keep the log interval's resolution.
# A progress read returns all N records, and so does the search of every store of one (a DHT find
# returns what each node it asks holds), so they hold these fields alone: ~200 bytes against ~425-600
# with 2-4 multiaddrs. The rest of what `status` shows (addresses, device, data position, bans) is a
# status record under its own key, stored every STATUS_EVERY seconds and read by `status`, `monitor`,
# the claims' first epoch and a restarting DHT only (docs/scale.md, "One compact record per peer").
PROGRESS_FIELDS = ("outer_step", "inner_step", "tokens_per_s", "time", "due", "period", "round", "dims", "speed",
                   "round_s", "cell", "loss", "eval_loss", "group_size", "rounds_applied", "rounds_failed", "left")
STATUS_EVERY = 30.0


def publish_progress(dht: hivemind.DHT, cfg, record: dict, every: Optional[float] = None) -> None:
    """Fire-and-forget: this peer's latest progress (record's PROGRESS_FIELDS), expiring so that dead
    peers drop out (after three times `every`, the seconds between our stores, and at least 15 s)."""
    if "records" not in LEGACY_DHT:
        record = {k: record[k] for k in PROGRESS_FIELDS if k in record}
    _store_record(dht, f"{cfg.dht_prefix}_progress", record, every or cfg.log_interval)


def publish_status(dht: hivemind.DHT, cfg, record: dict, every: float) -> None:
    """Fire-and-forget: this peer's whole record, for `status` (see PROGRESS_FIELDS)."""
    if "records" not in LEGACY_DHT:  # legacy: the progress record holds it all
        _store_record(dht, f"{cfg.dht_prefix}_status", record, every)


def _store_record(dht: hivemind.DHT, key: str, record: dict, every: float):
    return dht.store(key, subkey=str(dht.peer_id), value=record,
                     expiration_time=get_dht_time() + max(15.0, 3 * every), return_future=True)


def publish_leaving(dht: hivemind.DHT, cfg, record: dict, every: float, timeout: float = 2.0) -> None:
    """A peer that stops says so in its records ("left": true), so that the others stop counting it at
    their next read instead of when its record expires (up to 3 log intervals of groups that wait out
    the window for it). Waits up to `timeout` for the stores."""
    record = {**record, "left": True}
    legacy = "records" in LEGACY_DHT  # the progress record holds it all
    progress = record if legacy else {k: record[k] for k in PROGRESS_FIELDS if k in record}
    futures = [_store_record(dht, f"{cfg.dht_prefix}_progress", progress, every)]
    if not legacy:
        futures.append(_store_record(dht, f"{cfg.dht_prefix}_status", record, max(every, STATUS_EVERY)))
    deadline = time.monotonic() + timeout
    for future in futures:
        try:
            future.result(timeout=max(0.0, deadline - time.monotonic()))
        except Exception as e:  # the others then drop us when the record expires, as after a crash
            logger.debug(f"could not publish that we leave: {e!r}")


PROGRESS_RAMP = 4.0  # a peer's first reads: spaced by no more than a quarter of its age (progress_read_every)
PROGRESS_READ_PEERS = 8  # up to this many peers, each reads the progress records every log interval


def progress_read_every(cfg, swarm_size: int, age: Optional[float] = None) -> float:
    """Seconds between a peer's reads of the progress records, and between its stores of its own. A
    read returns all N records, and a store's search asks up to 20 peers, so N peers reading and
    storing every log interval cost each of them O(N) bytes per interval (docs/scale.md, swarm
    size): past PROGRESS_READ_PEERS peers, both are spaced out in proportion, which keeps the bytes
    per peer flat, up to once a minute.

    age: seconds since this peer started. In its first minutes the spacing grows with it, no longer
    than age / PROGRESS_RAMP: the swarm's phase, round number and grid cells travel in these records, and
    256 founders that read them a minute apart from the start spent 20 periods split into phases
    and round numbers (lines of the grid whole in 0.77 of rounds in the simulation, 1.00 once settled;
    0.92-0.98 with the ramp, for about 1.3x the DHT bytes over the first 13 minutes)."""
    every = min(60.0, cfg.log_interval * max(1.0, swarm_size / PROGRESS_READ_PEERS))
    if age is not None:
        every = min(every, max(cfg.log_interval, age / PROGRESS_RAMP))
    return every


def read_progress(dht: hivemind.DHT, cfg, timeout: Optional[float] = None, *, key: str = "progress"
                  ) -> dict[str, dict]:
    """The live peers' latest progress records (a TimeoutError after timeout seconds)."""
    future = dht.get(f"{cfg.dht_prefix}_{key}", latest=True, return_future=True)
    return parse_progress(future.result(timeout=timeout))


def read_status(dht: hivemind.DHT, cfg, timeout: Optional[float] = None) -> dict[str, dict]:
    """The peers' latest status records (addresses, data position: see PROGRESS_FIELDS)."""
    return read_progress(dht, cfg, timeout, key="progress" if "records" in LEGACY_DHT else "status")


def parse_progress(found) -> dict[str, dict]:
    """peer id -> progress record, from the result of a DHT get of the progress key."""
    if found is None or not isinstance(found.value, dict):
        return {}
    return {str(k): v.value for k, v in found.value.items() if isinstance(v.value, dict)}
