"""Joining the swarm: the hivemind DHT, this peer's addresses, and the small records peers
publish in the DHT (progress for `status`, the run's config fingerprint).

    >>> dht = start_dht(cfg)                  # raises SwarmError if no initial peer answers
    >>> write_maddrs(dht, "a.txt")
    >>> check_run_config(dht, cfg)            # SwarmError if the run uses another model config
    >>> publish_progress(dht, cfg, {"outer_step": 3, ...})
    >>> records = read_progress(dht, cfg)     # peer id -> latest record, dead peers expire

Any hivemind DHT node (e.g. `hivemind-dht`) can serve as an initial peer.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.secret import SecretValidator, public_key, verifier

logger = logging.getLogger(__name__)


class SwarmError(RuntimeError):
    """The swarm cannot be joined as asked; the CLI reports it on one line and exits 2."""


def is_loopback(maddr: str) -> bool:
    return maddr.startswith("/ip4/127.") or maddr.startswith("/ip6/::1/")


def start_dht(cfg) -> hivemind.DHT:
    """Start this peer's DHT node (and its p2pd daemon) and bootstrap through cfg.initial_peers."""
    local_only = all(is_loopback(m) for m in cfg.host_maddrs)
    kwargs = dict(
        initial_peers=list(cfg.initial_peers) or None,
        host_maddrs=list(cfg.host_maddrs),
        announce_maddrs=list(cfg.announce_maddrs) or None,
        identity_path=cfg.identity_path or None,
        client_mode=cfg.client_mode,
        use_relay=cfg.use_relay,
        use_auto_relay=cfg.use_auto_relay,
        bootstrap_timeout=cfg.bootstrap_timeout,
        startup_timeout=cfg.bootstrap_timeout,
        ensure_bootstrap_success=True,
        # a loopback-only peer has nothing to map on a router: no UPnP/NAT-PMP traffic
        nat_port_map=not local_only,
        auto_nat=not local_only,
    )
    if cfg.identity_path:
        Path(cfg.identity_path).parent.mkdir(parents=True, exist_ok=True)
    validators = [SecretValidator(cfg.run_secret, cfg.run_id)] if cfg.run_secret else []
    try:
        return hivemind.DHT(start=True, record_validators=validators, **kwargs)
    except Exception as e:  # p2pd and the DHT raise assorted types for the same failure
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if cfg.initial_peers:
            raise SwarmError(f"could not join through {', '.join(cfg.initial_peers)} "
                             f"within {cfg.bootstrap_timeout:.0f}s: {msg}") from None
        raise SwarmError(f"could not start the DHT on {', '.join(cfg.host_maddrs)}: {msg}") from None


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


def check_run_config(dht: hivemind.DHT, cfg) -> None:
    """Refuse to join a run whose live peers hold another secret or train another model config;
    then announce ours (and, with a secret, this peer's member record)."""
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
    if found is not None and isinstance(found.value, dict):
        theirs = {v.value for v in found.value.values() if isinstance(v.value, str)}
        if theirs and cfg.fingerprint() not in theirs:
            raise SwarmError(
                f"run {cfg.run_id!r} is training another model config or wire format (fingerprint "
                f"{', '.join(sorted(theirs))}, ours {cfg.fingerprint()}): use the swarm's preset or another --run-id")
    announce_config(dht, cfg)


def announce_config(dht: hivemind.DHT, cfg) -> None:
    """Publish (for 120 s; republished with progress) what joiners check: our model fingerprint,
    and with a secret the run's public verifier and our member record."""
    expiration = get_dht_time() + 120
    peer = str(dht.peer_id)
    dht.store(_run_key(cfg), subkey=peer, value=cfg.fingerprint(), expiration_time=expiration, return_future=True)
    if cfg.run_secret:
        dht.store(public_key(cfg.run_id), subkey=peer, value=verifier(cfg.run_secret, cfg.run_id),
                  expiration_time=expiration, return_future=True)
        dht.store(member_key(cfg), subkey=peer, value=True, expiration_time=expiration)


def member_key(cfg) -> str:
    return f"{cfg.dht_prefix}_members"


def publish_progress(dht: hivemind.DHT, cfg, record: dict) -> None:
    """Fire-and-forget: this peer's latest progress, expiring so that dead peers drop out."""
    ttl = max(15.0, 3 * cfg.log_interval)
    dht.store(f"{cfg.dht_prefix}_progress", subkey=str(dht.peer_id), value=record,
              expiration_time=get_dht_time() + ttl, return_future=True)


def read_progress(dht: hivemind.DHT, cfg, timeout: Optional[float] = None) -> dict[str, dict]:
    """The live peers' latest progress records (a TimeoutError after timeout seconds)."""
    future = dht.get(f"{cfg.dht_prefix}_progress", latest=True, return_future=True)
    return parse_progress(future.result(timeout=timeout))


def parse_progress(found) -> dict[str, dict]:
    """peer id -> progress record, from the result of a DHT get of the progress key."""
    if found is None or not isinstance(found.value, dict):
        return {}
    return {str(k): v.value for k, v in found.value.items() if isinstance(v.value, dict)}
