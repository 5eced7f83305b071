"""Can other peers dial this one? A dial-back check at startup, and what follows from its answer.

libp2p's AutoNAT answer is not exposed by hivemind's daemon, and a DHT ping proves nothing (it
comes back over the connection we opened). So a joiner asks a few live peers to open a FRESH TCP
connection to each address it announces (Petals does the same, PR #195). A peer that nobody can
dial is behind NAT or a firewall: it averages as a hivemind *client* (it sends its parts to the
reducers and reduces none), which needs outbound connections only, and its DHT becomes a client
too, so that nobody's lookups wait on a peer they cannot reach. Two such peers never need to dial
each other, which is what broke groups holding two NATed peers ("reducer dropped 1 sender").

    >>> serve(dht)                                   # every reachable peer answers dial-back requests
    >>> reach = check(dht, cfg, maddrs, helpers_for(dht, cfg))  # Reachability(mode="direct" | "client" | ...)
    >>> print(reach.explain(cfg))                    # one short paragraph for the volunteer

Modes: `direct` (dialed back), `client` (nobody could dial us, or --client-mode), `unknown` (no
peer answered: the first peer of a swarm), `local` (loopback only: nothing to check).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

from hivemind.p2p import PeerID
from hivemind.proto.runtime_pb2 import ExpertUID  # a message with one string field: our JSON travels in it

from p2pdiloco import bootstrap, swarm

logger = logging.getLogger(__name__)

HANDLER = "p2pdiloco.dial_back"
DIAL_TIMEOUT = 3.0   # one TCP connect from the helper to one of our addresses
ASK_TIMEOUT = 8.0    # one helper's whole answer (it dials up to MAX_ADDRS addresses in parallel)
MAX_ADDRS = 8
MAX_HELPERS = 3


@dataclass
class Reachability:
    mode: str                      # direct | client | unknown | local
    reached: list = field(default_factory=list)     # our addresses some helper could dial
    tried: list = field(default_factory=list)       # our addresses the helpers were asked to dial
    answers: int = 0               # helpers that answered
    errors: dict = field(default_factory=dict)      # address -> why a helper could not dial it
    check_s: float = 0.0

    @property
    def client(self) -> bool:
        return self.mode == "client"

    def explain(self, cfg, *, forced: bool = False) -> str:
        """What a volunteer reads at startup: where others reach us, or why not and what to do."""
        if self.mode == "local":
            return "p2pdiloco: listening on loopback only: peers on this machine only."
        if self.mode == "direct" and not self.answers:
            return "p2pdiloco: reachability = public: assumed reachable, not checked."
        if self.mode == "direct":
            return (f"p2pdiloco: reachable: {self.answers} peer(s) dialed us back at {', '.join(self.reached)}; "
                    "we reduce parts of our groups' averages.")
        if self.mode == "unknown":
            return ("p2pdiloco: reachability unknown: no other peer answered a dial-back request (the first peer "
                    "of a swarm); others can join only if they can dial " + (", ".join(self.tried) or "us") + ".")
        if forced:
            return ("p2pdiloco: client mode: we send our parts to reachable peers and reduce none; every group "
                    "needs at least one reachable peer.")
        # the port must stay the same across restarts to be forwarded: ours if fixed, else the volunteer preset's
        port = next((p for p in (_port([m]) for m in cfg.host_maddrs) if p and p != "0"), "31337")
        why = "; ".join(f"{a}: {e}" for a, e in list(self.errors.items())[:2]) or "no answer"
        return (f"p2pdiloco: NOT reachable: {self.answers} peer(s) tried to dial us and none could ({why}).\n"
                "  Averaging as a client: we send our parts to reachable peers and reduce none (only outbound "
                "connections needed; every group needs one reachable peer).\n"
                f"  To be reachable: forward TCP port {port} on your router to this machine and pass "
                f"--host-maddrs /ip4/0.0.0.0/tcp/{port} --announce-maddrs /ip4/<your public ip>/tcp/{port}; "
                "or pass --client-mode to skip this check.")


def _port(maddrs: list) -> Optional[str]:
    for m in maddrs:
        parts = str(m).split("/")
        if "tcp" in parts:
            return parts[parts.index("tcp") + 1]
    return None


def dialable_targets(maddrs) -> list[tuple[str, str, int]]:
    """(maddr, host, port) of the TCP addresses worth dialing back: no loopback, no relay circuit."""
    out = []
    for m in maddrs:
        text = str(m)
        if "p2p-circuit" in text:
            continue
        parts = text.split("/")
        try:
            proto, host = parts[1], parts[2]
            port = int(parts[parts.index("tcp") + 1])
        except (IndexError, ValueError):
            continue
        if proto not in ("ip4", "ip6") or host.startswith("127.") or host in ("::1", "0.0.0.0", "::"):
            continue
        base = f"/{proto}/{host}/tcp/{port}"
        if all(base != t[0] for t in out):
            out.append((base, host, port))
    return out[:MAX_ADDRS]


# ------------------------------------------------------------------ the helper's side (DHT process)


async def _tcp_probe(host: str, port: int) -> str:
    """'' if a fresh TCP connection to host:port opens, else why not (bootstrap's wording)."""
    return await asyncio.to_thread(bootstrap.connect_error, host, port, timeout=DIAL_TIMEOUT) or ""


async def _handle(request: ExpertUID, context) -> ExpertUID:
    try:
        asked = json.loads(request.uid).get("maddrs", [])
        targets = dialable_targets([m for m in asked if isinstance(m, str)])
    except (ValueError, AttributeError):
        targets = []
    results = await asyncio.gather(*(_tcp_probe(host, port) for _, host, port in targets))
    answer = {"reached": [t[0] for t, err in zip(targets, results) if not err],
              "errors": {t[0]: err for t, err in zip(targets, results) if err}}
    return ExpertUID(uid=json.dumps(answer))


async def _serve(_dht, node) -> None:
    await node.p2p.add_protobuf_handler(HANDLER, _handle, ExpertUID)


def serve(dht) -> None:
    """Answer other peers' dial-back requests (from our DHT process, for as long as it lives)."""
    dht.run_coroutine(_serve)


# ------------------------------------------------------------------ the asking side


async def _ask(_dht, node, helpers: list, maddrs: list) -> list:
    request = ExpertUID(uid=json.dumps({"maddrs": maddrs}))

    async def one(peer: str):
        try:
            reply = await asyncio.wait_for(
                node.p2p.call_protobuf_handler(PeerID.from_base58(peer), HANDLER, request, ExpertUID), ASK_TIMEOUT)
            return json.loads(reply.uid)
        except Exception as e:  # no such handler (a stock DHT node), gone, slow: not an answer
            logger.debug(f"dial-back request to {peer} failed: {e!r}")
            return None

    return list(await asyncio.gather(*(one(p) for p in helpers)))


def helpers_for(dht, cfg, progress: Optional[dict] = None) -> list[str]:
    """Peers to ask: the initial peers, then live peers of the run (from their progress records)."""
    me = str(dht.peer_id)
    candidates = [swarm.peer_id_of(m) for m in cfg.initial_peers] + list(progress or {})
    out = []
    for peer in candidates:
        if peer and peer != me and peer not in out:
            out.append(peer)
    return out[:MAX_HELPERS * 2]


def check(dht, cfg, maddrs: list, helpers: list) -> Reachability:
    """Ask `helpers` (peer ids) to dial our `maddrs` back; client if none of those that answered could."""
    t0 = time.monotonic()
    targets = [t[0] for t in dialable_targets(maddrs)]
    if not targets:
        return Reachability(mode="local")
    answers = [a for a in dht.run_coroutine(partial(_ask, helpers=helpers, maddrs=targets)) if isinstance(a, dict)]
    answers = answers[:MAX_HELPERS]
    reach = Reachability(mode="unknown", tried=targets, answers=len(answers))
    for a in answers:
        for m in a.get("reached", []):
            if m in targets and m not in reach.reached:
                reach.reached.append(m)
        errors = a.get("errors")
        if isinstance(errors, dict):
            reach.errors.update({k: str(v)[:80] for k, v in errors.items() if k in targets})
    if answers:
        # reachable if more than half of the helpers got through (Petals' rule, ≥ 0.5 of requests)
        ok = sum(1 for a in answers if any(m in targets for m in a.get("reached", [])))
        reach.mode = "direct" if 2 * ok >= len(answers) else "client"
    reach.check_s = time.monotonic() - t0
    return reach
