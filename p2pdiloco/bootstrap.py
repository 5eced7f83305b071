"""Starting this peer's DHT node through the initial peers, and saying why it failed.

    >>> dht = start_dht(cfg, stop_event=stop)  # retries dead initial peers; SwarmError says why none worked

Initial peers are probed over TCP and retried with exponential backoff until `bootstrap_timeout`
(peers may start in any order); the DHT starts through those that answer. When hivemind still
fails, each peer is dialed from a throwaway p2pd to name the cause in one line: connection
refused, timed out, no route, a name that does not resolve, another peer id at that address, a
port that does not speak libp2p.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import hivemind
from hivemind.utils.multiaddr import Multiaddr

from p2pdiloco.pipes import guard_pipes
from p2pdiloco.secret import SecretValidator
from p2pdiloco.swarm import LEGACY_DHT, SwarmError, is_loopback

logger = logging.getLogger(__name__)


# Kademlia's k (the routing buckets and every search's beam) and the copies of each record; hivemind's are 20 and
# 5. Measured in docs/scale.md ("DHT bytes per peer"): scale.py swarm --sizes 4 16 [--legacy-dht beam]
DHT_BUCKET_SIZE = 4
DHT_REPLICAS = 3


def start_dht(cfg, *, stop_event: Optional[threading.Event] = None) -> hivemind.DHT:
    """Start this peer's DHT node (and its p2pd daemon) and bootstrap through cfg.initial_peers.

    Initial peers that do not answer are retried with backoff until bootstrap_timeout (peers may
    start in any order); the DHT starts through those that answer. Raises SwarmError (one line:
    which addresses failed and why), or KeyboardInterrupt once stop_event is set."""
    stop_event = stop_event or threading.Event()
    sweep_stale_sockets()
    if cfg.identity_path:
        Path(cfg.identity_path).parent.mkdir(parents=True, exist_ok=True)
    if not cfg.initial_peers:
        try:
            return _launch(cfg, [], stop_event)
        except _StartFailed as e:
            raise SwarmError(f"could not start the DHT on {', '.join(cfg.host_maddrs)}: {e}") from None
    return _bootstrap(cfg, [parse_initial_peer(a) for a in cfg.initial_peers], stop_event)


def sweep_stale_sockets(directory: str = "/tmp", min_age_s: float = 60.0) -> int:
    """Remove the unix sockets of p2pd daemons and clients that died without cleaning up (a
    SIGKILLed peer leaves three in /tmp; a volunteer's machine would collect thousands over months of
    crashes). A socket is stale when nothing listens on it; young ones are left alone, in case a
    daemon starting beside us has bound but not yet listened. Returns how many were removed."""
    removed = 0
    now = time.time()
    for path in Path(directory).glob("hivemind-p2p*.sock"):
        try:
            if now - path.lstat().st_mtime < min_age_s or not path.is_socket():
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(0.2)
                probe.connect(str(path))
        except ConnectionRefusedError:
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
        except OSError:  # gone meanwhile, not ours, busy: leave it
            continue
    return removed


# --------------------------------------------------------------------------- bootstrapping
#
# Why the DHT gets only the initial peers that answered a TCP probe: p2pd connects to its bootstrap
# peers one after another under a single 60 s budget before it even prints its peer id
# (go-libp2p-daemon bootstrap.go), so one dead peer that drops packets can eat the whole startup;
# hivemind then waits bootstrap_timeout for pings that will never come back. The live ones are
# enough: the DHT learns the rest of the swarm from them.

PROBE_TIMEOUT = 3.0           # one TCP connect to one initial peer
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 5.0
P2PD_BOOTSTRAP_S = 60.0       # p2pd gives up connecting to its bootstrap peers after this
DIAL_TIMEOUT = 8.0            # one libp2p dial from a throwaway daemon, to explain a failed start
PEER_ID_MISMATCH = "the peer id does not match"


@dataclass
class InitialPeer:
    addr: str
    peer_id: str
    host: Optional[str] = None    # the TCP endpoint a probe connects to (None: not TCP, not probed)
    port: int = 0
    family: int = socket.AF_UNSPEC


class _StartFailed(Exception):
    """hivemind.DHT did not start; the message is hivemind's (its last line)."""


def parse_initial_peer(addr: str) -> InitialPeer:
    """Split /ip4|ip6|dns*/HOST/tcp/PORT/.../p2p/ID into what the probe and the diagnosis need."""
    try:
        items = [(proto.name, value) for proto, value in Multiaddr(addr).items()]
    except Exception as e:  # the vendored multiaddr raises several unrelated types
        raise SwarmError(f"malformed initial peer {addr!r}: {e}") from None
    ids = [value for name, value in items if name == "p2p"]
    if not ids:
        raise SwarmError(f"initial peer {addr} has no /p2p/<peer id> part: copy the whole address a peer prints")
    peer = InitialPeer(addr, ids[-1])  # the last one: a relayed address names the relay first
    families = {"ip4": socket.AF_INET, "ip6": socket.AF_INET6, "dns4": socket.AF_INET, "dns6": socket.AF_INET6,
                "dns": socket.AF_UNSPEC}
    for (name, value), (next_name, next_value) in zip(items, items[1:]):
        if name in families and next_name == "tcp":
            peer.host, peer.port, peer.family = value, int(next_value), families[name]
            break
    return peer


def probe(peer: InitialPeer, timeout: float = PROBE_TIMEOUT) -> Optional[str]:
    """None if the peer's TCP port accepts a connection (or it has none to probe), else why not."""
    if peer.host is None:
        return None
    return connect_error(peer.host, peer.port, timeout=timeout, family=peer.family)


def connect_error(host: str, port: int, *, timeout: float, family: int = socket.AF_UNSPEC) -> Optional[str]:
    """None if a fresh TCP connection to host:port opens, else why not, in the words our errors use
    (also the dial-back check's, reachability.py)."""
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    except socket.gaierror:
        return "name does not resolve"
    error: Optional[OSError] = None
    for family, kind, proto, _, sockaddr in infos[:4]:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(timeout)
                sock.connect(sockaddr)
            return None
        except OSError as e:
            error = e
    return _socket_reason(error)


def _socket_reason(e: Optional[OSError]) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError):  # socket.timeout too
        return "timed out"
    if e is not None and e.errno == errno.EHOSTUNREACH:
        return "no route to host"
    if e is not None and e.errno == errno.ENETUNREACH:
        return "network unreachable"
    return (e.strerror or str(e)) if e is not None else "no address"


def _probe_all(peers: list[InitialPeer]) -> dict[str, Optional[str]]:
    """Probe every peer at once; a name lookup that hangs counts as not resolving."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(peers)))
    try:
        futures = {p.addr: pool.submit(probe, p) for p in peers}
        concurrent.futures.wait(futures.values(), timeout=PROBE_TIMEOUT + 2)
        return {a: f.result() if f.done() else "name does not resolve (lookup timed out)" for a, f in futures.items()}
    finally:
        pool.shutdown(wait=False)


def _bootstrap(cfg, peers: list[InitialPeer], stop_event: threading.Event) -> hivemind.DHT:
    """Probe the initial peers until one answers, start the DHT through those that do; retry both
    with exponential backoff until bootstrap_timeout."""
    t0 = time.monotonic()
    deadline = t0 + cfg.bootstrap_timeout
    why: dict[str, str] = {}      # address -> why it failed last
    wrong: set[str] = set()       # addresses that will never work: another peer answers there
    delay, attempts = BACKOFF_FIRST, 0
    while True:
        attempts += 1
        candidates = [p for p in peers if p.addr not in wrong]
        answers = _probe_all(candidates)
        why.update({a: r for a, r in answers.items() if r is not None})
        live = [p for p in candidates if answers[p.addr] is None]
        if live:
            try:
                return _launch(cfg, [p.addr for p in live], stop_event)
            except _StartFailed as e:
                causes = _diagnose(live, str(e))
                if all(c is None for c in causes.values()) and not _ping_failed(str(e)):
                    # every peer answers libp2p: the trouble is on our side (a port in use, p2pd itself)
                    raise SwarmError(f"could not start the DHT on {', '.join(cfg.host_maddrs)}: {e}") from None
                why.update({a: c or _dht_reason(str(e)) for a, c in causes.items()})
                wrong |= {a for a, c in causes.items() if c and c.startswith(PEER_ID_MISMATCH)}
        now = time.monotonic()
        if now >= deadline or len(wrong) == len(peers):
            raise SwarmError(_join_error(peers, why, now - t0, retried=attempts > 1))
        logger.info(f"no initial peer could be joined yet ({'; '.join(f'{a}: {r}' for a, r in why.items())}); "
                    f"retrying in {delay:.1f}s")
        if stop_event.wait(min(delay, deadline - now)):
            raise KeyboardInterrupt
        delay = min(2 * delay, BACKOFF_MAX)


def _join_error(peers: list[InitialPeer], why: dict[str, str], elapsed: float, retried: bool) -> str:
    tried = f" (retried for {elapsed:.0f} s)" if retried else ""
    if len(peers) == 1:
        return f"could not join through {peers[0].addr}: {why.get(peers[0].addr, 'no answer')}{tried}"
    return (f"could not join through any of {len(peers)} initial peers{tried}: "
            + "; ".join(f"{p.addr}: {why.get(p.addr, 'no answer')}" for p in peers))


def _launch(cfg, initial_peers: list[str], stop_event: threading.Event) -> hivemind.DHT:
    """Start hivemind's DHT process; raise _StartFailed with hivemind's reason, KeyboardInterrupt on stop."""
    local_only = all(is_loopback(m) for m in cfg.host_maddrs)
    # p2pd prints its id (what hivemind's startup_timeout waits for) only after connecting to its
    # bootstrap peers, which it may take up to 60 s to do
    startup_timeout = cfg.startup_timeout + (min(P2PD_BOOTSTRAP_S, cfg.bootstrap_timeout) if initial_peers else 0)
    kwargs = dict(
        initial_peers=initial_peers or None,
        host_maddrs=list(cfg.host_maddrs),
        announce_maddrs=list(cfg.announce_maddrs) or None,
        identity_path=cfg.identity_path or None,
        client_mode=cfg.client_mode,
        use_relay=cfg.use_relay,
        use_auto_relay=cfg.use_auto_relay,
        bootstrap_timeout=cfg.bootstrap_timeout,
        startup_timeout=startup_timeout,
        ensure_bootstrap_success=True,
        # a loopback-only peer has nothing to map on a router: no UPnP/NAT-PMP traffic
        nat_port_map=not local_only,
        auto_nat=not local_only,
    )
    if "cache" not in LEGACY_DHT:
        # hivemind caches every value a node fetches, refreshes it before it expires, and puts it in its
        # replies to every search that passes by: the progress records (a dict of N entries every peer
        # reads) then rode along with every store's search, ~N^2 bytes per peer per minute (docs/scale.md)
        kwargs.update(cache_locally=False, cache_nearest=0, cache_refresh_before_expiry=0)
    if "beam" not in LEGACY_DHT:
        # hivemind's Kademlia k is 20: every lookup keeps a beam of 20 nodes and has no early stop for a
        # latest=True read, so below 21 peers every read and every store's search asks all N - 1 others
        # and the DHT bytes per peer per round grow with N (docs/scale.md, "DHT bytes per peer"). A beam
        # of DHT_BUCKET_SIZE nodes holding DHT_REPLICAS copies asks the same few nodes at 4 peers or 16.
        kwargs.update(bucket_size=DHT_BUCKET_SIZE, num_replicas=DHT_REPLICAS)
    validators = [SecretValidator(cfg.run_secret, cfg.run_id)] if cfg.run_secret else []
    dht = hivemind.DHT(start=False, record_validators=validators, **kwargs)
    guard_pipes(dht)  # large records from several threads (pipes.py)
    dht.run_in_background(await_ready=False)
    # hivemind bounds each stage (the identity check, p2pd, the pings, the first lookup); this bounds them all
    budget = 15 + startup_timeout + 2 * cfg.bootstrap_timeout + 10
    limit = time.monotonic() + budget
    ready = False
    try:
        while True:
            try:
                dht.wait_until_ready(timeout=0.25)
                ready = True
                return dht
            except TimeoutError:
                if not dht.is_alive():  # it ended without a word (or with a TimeoutError of its own)
                    raise _StartFailed("the DHT process ended before it was ready") from None
            except Exception as e:  # p2pd and the DHT raise assorted types for the same failure
                raise _StartFailed(_last_line(e)) from None
            if stop_event.is_set():
                raise KeyboardInterrupt
            if time.monotonic() > limit:
                raise _StartFailed(f"the DHT was not ready after {budget:.0f}s")
    finally:
        if not ready:
            _abandon(dht)


def _abandon(dht: hivemind.DHT) -> None:
    """Stop a DHT that did not start; a node that is almost up is let finish, so that it stops its p2pd."""
    if dht.is_alive():
        try:
            dht.wait_until_ready(timeout=4.0)
        except Exception:  # failed or still starting: shutdown copes with both
            pass
        dht.shutdown()


def _last_line(e: BaseException) -> str:
    text = re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", str(e)).strip()  # p2pd's log timestamps
    return text.splitlines()[-1] if text else type(e).__name__


def _ping_failed(msg: str) -> bool:
    return "responded to a ping" in msg


def _dht_reason(msg: str) -> str:
    """Why the start failed through a peer that answers libp2p."""
    if _ping_failed(msg):
        return "it speaks libp2p but not the hivemind DHT (not a p2pdiloco peer or hivemind DHT node?)"
    return msg


def _diagnose(peers: list[InitialPeer], msg: str) -> dict[str, Optional[str]]:
    """After a failed start, dial each peer from a throwaway p2pd to learn why (None: it answers).

    hivemind reports only "failed to connect to bootstrap peers"; the dial says which and why."""
    try:
        reasons = asyncio.run(asyncio.wait_for(_dial_all(peers), DIAL_TIMEOUT + 20))
    except Exception as e:  # the diagnosis is best effort: fall back to hivemind's words
        logger.debug(f"could not diagnose the failed start: {e!r}")
        return {p.addr: msg for p in peers}
    return dict(zip([p.addr for p in peers], reasons))


async def _dial_all(peers: list[InitialPeer]) -> list[Optional[str]]:
    return list(await asyncio.gather(*(_dial(p) for p in peers)))


async def _dial(peer: InitialPeer) -> Optional[str]:
    """One fresh daemon per peer: no dial backoff or peerstore entries carried over from another dial."""
    from hivemind.p2p import P2P, PeerID
    from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], dht_mode="client", auto_nat=False,
                           nat_port_map=False, startup_timeout=15)
    try:
        target = Multiaddr(peer.addr).decapsulate(Multiaddr(f"/p2p/{peer.peer_id}"))
        # hivemind has no public connect; its own identity check dials the same way
        await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer.peer_id), [target]), DIAL_TIMEOUT)
        return None
    except ControlFailure as e:
        return libp2p_reason(str(e))
    except asyncio.TimeoutError:
        return f"no libp2p answer within {DIAL_TIMEOUT:.0f}s"
    finally:
        await p2p.shutdown()


def libp2p_reason(msg: str) -> str:
    """A short cause from p2pd's dial error ('failed to dial ...:\n  * [ADDR] REASON')."""
    if "peer id mismatch" in msg:
        found = re.search(r"remote key matches (\w+)", msg)
        there = f": the peer at that address is {found.group(1)}" if found else ""
        return f"{PEER_ID_MISMATCH}{there}"
    if "failed to negotiate security protocol" in msg and ("deadline exceeded" in msg or "timeout" in msg):
        return "the libp2p handshake timed out: something listens there but does not speak libp2p"
    for words, reason in (("connection refused", "connection refused"), ("no route to host", "no route to host"),
                          ("network is unreachable", "network unreachable"), ("i/o timeout", "timed out"),
                          ("deadline exceeded", "timed out"), ("no such host", "name does not resolve")):
        if words in msg:
            return reason
    bullets = [line.split("]", 1)[-1].strip() for line in msg.splitlines() if line.strip().startswith("* [")]
    return (bullets[0] if bullets else _last_line(Exception(msg)))[:200]
