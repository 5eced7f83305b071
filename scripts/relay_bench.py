#!/usr/bin/env python3
"""Bulk data between two NATed peers through a public libp2p circuit relay (v2, hivemind 1.1.12's
bundled p2pd): throughput, whether a stream dies at go-libp2p's default relay budget (128 KiB per
direction or 2 min per relayed connection), which knob changes that, and a direct public->public
transfer at the same rate limit for scale.

    python scripts/relay_bench.py            # 3+ relays per variant, 1/4/16 MB, 130 s trickles: ~2.5-3 min
    python scripts/relay_bench.py --quick    # 2 relays per variant, 1 MB probes + direct: ~30-40 s
    python scripts/relay_bench.py --json out.json --rate 50 --keep-logs

Lab (scripts/netns.py): Namespaces(4, nat=[1, 2], rate_mbit=R). Host 0 is public and runs the relays,
each its own hivemind P2P (use_relay=True, force_reachability="public", auto_nat=False,
nat_port_map=False) on 10.213.0.1. Hosts 1 and 2 sit behind their own home NATs (nobody can
connect in): host 1 runs one receiver per relay, host 2 one sender, each a P2P with use_relay=True,
use_auto_relay=True, trusted_relays=[relay], initial_peers=[relay], force_reachability="private",
auto_nat=False (no hole punching: traffic stays relayed) and -relayDiscovery=0 (static relay).
Host 3 is public: host 3 -> a relay's own P2P is the direct transfer; a raw TCP transfer 3 -> 0
gives the wire rate.

Relay variants (each started `--relays` times, in parallel):
  default  P2P.create exactly as hivemind exposes it
  flags    the knob: a P2P subclass whose _make_process_args adds -relayDataLimit=4294967296
           -relayTimeLimit=30m -relayBufferSize=16777216 to the relay's p2pd (relays enforce limits)
What a relay does is decided inside p2pd: -relay=1 makes it call EnableRelayV2 (go-libp2p's relay
with DefaultResources: 128 KiB, 2 min) *and* start the relay service built from the -relay* flags
once reachability is Public; both register the hop protocol and the last one wins. So each relay
gets a 1 MB probe through it, and its "limit" is what the probe showed: "128KiB" (cut) or "raised".
The full run then sends 4 and 16 MB through a "raised" relay if the run has one, and trickles
1000 B every 2 s for 130 s (under 128 KiB) through a "128KiB" and a "raised" relay, to see the
2-minute limit act. It also starts one receiver with hivemind's default -relayDiscovery=1 and
watches for its reservation. Reservation times come from the relays' own logs (go-libp2p logger
"relay" at debug, read through P2P._log_p2pd_message); "reach" is when the sender first got a
circuit to the receiver.

The receiver in host 1 registers a binary stream handler; the sender dials the receiver's
/p2p-circuit address (<relay maddr>/p2p-circuit: autorelay never advertises it here, since it keeps
only a relay's public addresses and the lab is 10.x) and writes a 16-byte header (transfer id,
length) plus N bytes; the receiver counts them, notes when, and acks the count. A relay reset
shows as fewer bytes delivered than sent. Rates are bytes / (first to last byte at the receiver).

Each party is a separate Python process in its namespace (`--role node`), driven by JSON lines on
stdin/stdout; every wait is bounded; every process (in its own session, p2pd daemons included) and
the namespaces are removed in `finally`. Prints a human table, then the JSON summary as the last
line (also written to --json). Exit 0 = measured (whatever the relays did), 1 = the bench itself
failed, 2 = network namespaces unavailable here (one line).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import ClassVar

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MB = 1_000_000
HEADER = 16  # transfer id, length: two big-endian u64
HANDLER = "relay_bench"
CALL_TIMEOUT_S = 90.0  # a child's first answer includes `import hivemind` (~5 s, more on a busy box)
CIRCUIT_TIMEOUT_S = 45.0  # a NATed receiver must be reachable through its relay within this
TRICKLE_S = 130  # > go-libp2p's default 2-minute relay time limit

# The knob: p2pd flags that hivemind.P2P.create cannot pass, given to the relay's daemon through a
# subclass (see make_p2p_class). Values: go-libp2p-daemon v0.5.0.hivemind1 flag syntax.
RAISED_FLAGS = {"relayDataLimit": 1 << 32, "relayTimeLimit": "30m", "relayBufferSize": 1 << 24}
VARIANTS = {"default": {}, "flags": RAISED_FLAGS}  # relay: hivemind's P2P.create as is / + the knob
DEFAULT_DATA_LIMIT = 1 << 17  # go-libp2p circuit v2 DefaultResources().Limit.Data (per direction)
PROBE_BYTES = 1 * MB
# For the NATed peers: -relayDiscovery=0 makes trusted_relays static relays (autorelay's minCandidates
# = their number), so the reservation is made at once and only there. With p2pd's default (1),
# autorelay also takes DHT-found candidates (any directly connected peer speaking the hop protocol:
# every p2pd with -relay=1, NATed ones included) and waits for 4 of them or its 3-minute boot delay;
# the full run measures that case too.
NAT_FLAGS = {"relayDiscovery": 0}


# =============================================================================================
# child: one process per namespace, hosting any number of hivemind P2P instances
# =============================================================================================

RESERVATION_MSG = "reserving relay slot for "  # go-libp2p circuitv2 relay, debug level (logger "relay")
RESERVATIONS: list = []  # (instance name, peer id, unix time) of each reservation a daemon here granted
RELAYED: list = []  # (instance name, bytes, from peer, to peer): a relayed connection's direction, at its end


def make_p2p_class(extra_flags: dict, name: str = ""):
    """hivemind.P2P plus, if extra_flags, the knob: p2pd flags that P2P.create cannot pass (the
    daemon's argv is built by P2P._make_process_args, a static method called on the instance's
    class). Also notes the relay reservations the daemon logs (see _child_main: GOLOG_LOG_LEVEL)."""
    from hivemind.p2p import P2P

    class BenchP2P(P2P):
        EXTRA_P2PD_FLAGS: ClassVar[dict] = dict(extra_flags)

        @classmethod
        def _make_process_args(cls, *args, **kwargs):
            return P2P._make_process_args(*args, **kwargs, **cls.EXTRA_P2PD_FLAGS)

        def _log_p2pd_message(self, line: str) -> None:
            try:
                if RESERVATION_MSG in line:
                    peer = json.loads(line)["msg"].split(RESERVATION_MSG, 1)[1].split()[0]
                    RESERVATIONS.append((name, peer, time.time()))
                elif '"relayed ' in line:  # "relayed 131072 bytes from A to B"
                    words = json.loads(line)["msg"].split()
                    if words[0] == "relayed" and words[2:4] == ["bytes", "from"] and words[5] == "to":
                        RELAYED.append((name, int(words[1]), words[4], words[6]))
            except (ValueError, LookupError):
                pass
            P2P._log_p2pd_message(line)

    return BenchP2P


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def go_maddr(text: str):
    """A hivemind Multiaddr whose binary form p2pd (go-multiaddr) accepts.

    hivemind 1.1.12's Multiaddr encodes /p2p/<12D3Koo... id> as a CIDv1 (01 72 + multihash), and
    p2pd's CONNECT then fails with "length greater than remaining number of bytes in buffer";
    go-multiaddr wants the bare multihash. Rewrites each /p2p component accordingly."""
    from hivemind.utils.multiaddr import Multiaddr
    from hivemind.utils.multiaddr.protocols import protocol_with_code

    raw = Multiaddr(text).to_bytes()
    out, i = bytearray(), 0
    while i < len(raw):
        code, j = _varint(raw, i)
        size = protocol_with_code(code).size
        if size < 0:  # length-prefixed
            length, k = _varint(raw, j)
            value = raw[k:k + length]
            end = k + length
            if code == 421 and value[:2] == b"\x01\x72":  # p2p: CIDv1 libp2p-key -> multihash
                value = value[2:]
            out += _uvarint(code) + _uvarint(len(value)) + value
        else:
            end = j + size // 8
            out += raw[i:end]
        i = end
    return Multiaddr(bytes(out))


def _child_main() -> int:
    import asyncio
    import struct

    # our protocol owns the real stdout; anything else printed (logs) goes to stderr
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from hivemind.p2p import PeerID
    from hivemind.utils.logging import loglevel, python_level_to_golog

    # every daemon here logs go-libp2p's relay at debug level, so a relay's reservations show up
    # in BenchP2P._log_p2pd_message (hivemind hands p2pd os.environ and only setdefaults this)
    os.environ.setdefault("GOLOG_LOG_LEVEL", f"{python_level_to_golog(loglevel)},relay=debug")
    nodes: dict = {}  # name -> P2P
    received: dict = {}  # transfer id -> record (filled by the stream handler)
    done_events: dict = {}  # transfer id -> asyncio.Event

    def reply(msg: dict) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    def event_for(tid: int):
        if tid not in done_events:
            done_events[tid] = asyncio.Event()
        return done_events[tid]

    async def handler(info, reader, writer):
        t_open = time.monotonic()
        rec = {"bytes": 0, "expected": None, "first_s": None, "last_s": None, "error": None,
               "remote": str(info.addr) if getattr(info, "addr", None) is not None else None}
        tid = None
        try:
            hdr = await reader.readexactly(HEADER)
            tid, expected = struct.unpack("!QQ", hdr)
            rec["expected"] = expected
            received[tid] = rec
            while rec["bytes"] < expected:
                data = await reader.read(1 << 16)
                if not data:
                    rec["error"] = "EOF (stream closed/reset before all bytes arrived)"
                    break
                now = time.monotonic() - t_open
                if rec["first_s"] is None:
                    rec["first_s"] = now
                rec["bytes"] += len(data)
                rec["last_s"] = now
            if rec["bytes"] >= expected:
                writer.write(struct.pack("!Q", rec["bytes"]))
                await writer.drain()
                await asyncio.sleep(0.5)  # let the ack leave before the stream is closed
        except asyncio.IncompleteReadError:
            rec["error"] = "EOF before the header"
        except Exception as e:  # noqa: BLE001 - a reset is a result here, not a bug
            rec["error"] = f"{type(e).__name__}: {e}"
        finally:
            if tid is not None:
                event_for(tid).set()
            writer.close()

    async def op_start(name, host_maddrs, kind, relay=None, extra_flags=None):
        cls = make_p2p_class(extra_flags or {}, name)
        kwargs = {"host_maddrs": host_maddrs, "nat_port_map": False, "auto_nat": False, "use_relay": True,
                  "startup_timeout": 60}
        if kind == "relay":
            kwargs.update(force_reachability="public")
        elif kind == "nat":
            kwargs.update(initial_peers=[relay], use_auto_relay=True, trusted_relays=[relay],
                          force_reachability="private")
        elif kind != "public":
            raise ValueError(f"unknown kind {kind!r}")
        t0, wall0 = time.monotonic(), time.time()
        p2p = await cls.create(**kwargs)
        nodes[name] = p2p
        await p2p.add_binary_stream_handler(HANDLER, handler)
        maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        return {"peer_id": p2p.peer_id.to_base58(), "maddrs": maddrs, "create_s": time.monotonic() - t0,
                "start_wall": wall0}

    async def op_addrs(name):
        """What this daemon advertises (identify): a /p2p-circuit entry would mean autorelay
        published its relay address."""
        return {"maddrs": [str(m) for m in await nodes[name].get_visible_maddrs(latest=True)]}

    async def op_reach(name, peer_id, maddrs, timeout, interval=0.5):
        """Dial peer_id at maddrs (its /p2p-circuit address) until it works: the first success
        means the target holds a reservation on that relay. Wall-clock times, so the parent can
        compare them with the target's start."""
        p2p = nodes[name]
        pid = PeerID.from_base58(peer_id)
        deadline = time.monotonic() + timeout
        attempts, last_error = 0, None
        while True:
            attempts += 1
            try:
                await asyncio.wait_for(p2p._client.connect(pid, [go_maddr(m) for m in maddrs]), 10)
                path = [str(a) for info in await p2p.list_peers() if info.peer_id == pid for a in info.addrs]
                return {"reached": True, "wall": time.time(), "attempts": attempts, "path": path}
            except Exception as e:  # noqa: BLE001 - NO_RESERVATION, dial backoff, ...
                last_error = f"{type(e).__name__}: {e}"
            if time.monotonic() + interval > deadline:
                return {"reached": False, "wall": time.time(), "attempts": attempts, "last_error": last_error}
            await asyncio.sleep(interval)

    async def op_send(name, peer_id, maddrs, tid, nbytes, chunk=1 << 16, interval=0.0, timeout=60.0,
                      connect_timeout=15.0):
        """One stream to peer_id's bench handler: a 16-byte header, nbytes, then wait for the ack.
        A relay reset shows as ConnectionResetError/EOF here and as a short count at the receiver."""
        p2p = nodes[name]
        pid = PeerID.from_base58(peer_id)
        res = {"tid": tid, "nbytes": nbytes, "error": None, "ack": None, "path": None, "broke_at_s": None}
        t0 = time.monotonic()
        attempts = 0
        while True:  # a circuit the relay just reset may take a moment to be re-dialable
            attempts += 1
            try:
                await asyncio.wait_for(p2p._client.connect(pid, [go_maddr(m) for m in maddrs]), 10)
                break
            except Exception as e:  # noqa: BLE001
                if time.monotonic() - t0 > connect_timeout:
                    res["error"] = f"connect ({attempts} tries): {type(e).__name__}: {e}"
                    return res
                await asyncio.sleep(0.5)
        res["connect_s"] = time.monotonic() - t0
        res["connect_attempts"] = attempts
        res["path"] = [str(a) for info in await p2p.list_peers() if info.peer_id == pid for a in info.addrs]
        try:
            _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(pid, HANDLER), 20)
        except Exception as e:  # noqa: BLE001
            res["error"] = f"open stream: {type(e).__name__}: {e}"
            return res
        t1 = time.monotonic()
        try:
            async def push():
                writer.write(struct.pack("!QQ", tid, nbytes))
                buf = b"\x5a" * chunk
                left = nbytes
                while left > 0:
                    piece = buf if left >= chunk else buf[:left]
                    writer.write(piece)
                    await writer.drain()
                    left -= len(piece)
                    if interval:
                        await asyncio.sleep(interval)
                ack = await reader.readexactly(8)
                return struct.unpack("!Q", ack)[0]

            res["ack"] = await asyncio.wait_for(push(), timeout)
        except asyncio.TimeoutError:
            res["error"] = f"no ack within {timeout:.0f} s"
        except Exception as e:  # noqa: BLE001 - a reset is a result here
            res["error"] = f"{type(e).__name__}: {e}"
            res["broke_at_s"] = time.monotonic() - t1
        finally:
            writer.close()
        res["seconds"] = time.monotonic() - t1
        return res

    async def op_recv_result(tid, wait):
        try:
            await asyncio.wait_for(event_for(tid).wait(), wait)
        except asyncio.TimeoutError:
            rec = received.get(tid)
            return {"record": rec, "pending": True}
        return {"record": received[tid], "pending": False}

    async def op_ping():
        return {"pid": os.getpid()}

    async def op_relay_log():
        return {"reservations": [list(r) for r in RESERVATIONS], "relayed": [list(r) for r in RELAYED]}

    ops = {"start": op_start, "addrs": op_addrs, "reach": op_reach, "send": op_send, "recv_result": op_recv_result,
           "relay_log": op_relay_log, "ping": op_ping}

    async def run_one(msg):
        try:
            out = await ops[msg["op"]](**msg.get("args", {}))
            reply({"id": msg["id"], "ok": True, **out})
        except Exception as e:  # noqa: BLE001 - reported to the parent
            reply({"id": msg["id"], "ok": False, "error": f"{type(e).__name__}: {e}"})

    async def main():
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def read_stdin():
            for line in sys.stdin:
                loop.call_soon_threadsafe(queue.put_nowait, line)
            loop.call_soon_threadsafe(queue.put_nowait, None)  # parent gone or done

        threading.Thread(target=read_stdin, daemon=True).start()
        tasks = set()
        try:
            while (line := await queue.get()) is not None:
                task = asyncio.create_task(run_one(json.loads(line)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in tasks:
                task.cancel()
            for p2p in nodes.values():
                try:
                    await asyncio.wait_for(p2p.shutdown(), 5)
                except Exception:  # noqa: BLE001, S110 - the parent kills the process group anyway
                    pass

    reply({"id": 0, "ok": True, "ready": True})
    asyncio.run(main())
    return 0


# =============================================================================================
# parent: the lab, the children, the measurements
# =============================================================================================

class BenchError(RuntimeError):
    pass


class Child:
    """A `--role node` process in one namespace, in its own session (its p2pd daemons too)."""

    def __init__(self, label: str, argv: list[str], log_path: Path):
        self.label = label
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1, start_new_session=True)
        self._replies: dict[int, dict] = {}
        self._cv = threading.Condition()
        self._next = 1
        self._eof = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self._cv:
                self._replies[msg.get("id", -1)] = msg
                self._cv.notify_all()
        with self._cv:
            self._eof = True
            self._cv.notify_all()

    def submit(self, op: str, **args) -> int:
        with self._cv:
            rid = self._next
            self._next += 1
        try:
            self.proc.stdin.write(json.dumps({"id": rid, "op": op, "args": args}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError) as e:
            raise BenchError(f"{self.label}: process gone ({e}); log: {self.tail()}") from None
        return rid

    def result(self, rid: int, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self._cv:
            while rid not in self._replies:
                left = deadline - time.monotonic()
                if self._eof:
                    raise BenchError(f"{self.label}: exited (rc={self.proc.poll()}) before answering; "
                                     f"log: {self.tail()}")
                if left <= 0:
                    raise BenchError(f"{self.label}: no answer in {timeout:.0f} s; log: {self.tail()}")
                self._cv.wait(min(left, 1.0))
            msg = self._replies.pop(rid)
        if not msg.get("ok"):
            raise BenchError(f"{self.label}: {msg.get('error')}")
        return msg

    def call(self, op: str, wait_s: float, /, **args) -> dict:
        return self.result(self.submit(op, **args), wait_s)

    def tail(self, n: int = 600) -> str:
        try:
            self._log.flush()
            return self.log_path.read_text(errors="replace")[-n:].replace("\n", " | ")
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """EOF on stdin (graceful: P2P.shutdown), then SIGKILL to the whole session's group."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own session: python + its p2pd daemons
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def _groups_alive(pgids: list[int], wait_s: float = 5.0) -> list[int]:
    """Those of our children's process groups (python + p2pd) that still have a process."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for pgid in pgids:
            try:
                os.killpg(pgid, 0)
                alive.append(pgid)
            except ProcessLookupError:
                pass
            except PermissionError:
                alive.append(pgid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _mbps(nbytes: int | None, seconds: float | None) -> float | None:
    if not nbytes or not seconds or seconds <= 0:
        return None
    return round(nbytes / seconds / MB, 3)


class Bench:
    def __init__(self, children: dict[int, Child]):
        self.c = children
        self.tid = 0

    def transfer(self, sender: int, s_name: str, receiver: int, peer_id: str, maddrs: list[str], nbytes: int,
                 *, interval: float = 0.0, chunk: int = 1 << 16, timeout: float = 60.0, background: bool = False):
        """One stream from instance s_name in host `sender` to peer_id in host `receiver`; a dict
        (with background: a callable that waits for it and returns the dict)."""
        self.tid += 1
        tid = self.tid
        rid = self.c[sender].submit("send", name=s_name, peer_id=peer_id, maddrs=maddrs, tid=tid, nbytes=nbytes,
                                    chunk=chunk, interval=interval, timeout=timeout)

        def finish() -> dict:
            sent = self.c[sender].result(rid, timeout + 60)
            got = self.c[receiver].call("recv_result", 15, tid=tid, wait=10)
            rec = got.get("record") or {}
            delivered = rec.get("bytes", 0)
            span = rec.get("last_s")
            complete = delivered == nbytes and sent.get("ack") == nbytes
            return {"nbytes": nbytes, "delivered": delivered, "complete": complete,
                    # a rate only for whole transfers: a cut one is a buffer-sized burst
                    "mb_per_s": _mbps(delivered, span) if complete else None,
                    "receiver_seconds": None if span is None else round(span, 3),
                    "relayed": any("p2p-circuit" in a for a in (sent.get("path") or [])),
                    "path": sent.get("path"), "connect_s": sent.get("connect_s"),
                    "sender_error": sent.get("error"), "sender_broke_at_s": sent.get("broke_at_s"),
                    "receiver_error": rec.get("error"), "receiver_pending": got.get("pending")}

        return finish if background else finish()


def _fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def _bulk_timeout(nbytes: int, rate_mbit: float) -> float:
    return 20 + nbytes * 8 / (rate_mbit * 1e6) * 4


def _limit_seen(probe: dict) -> str:
    if probe["complete"]:
        return "raised"  # p2pd's relay service (RelayManager, -relay* flags) handled the hop protocol
    if probe["sender_error"] and probe["delivered"] == 0 and not probe["relayed"]:
        return "no-circuit"
    if 0 < probe["delivered"] <= DEFAULT_DATA_LIMIT:
        return "128KiB"  # go-libp2p's relay.New defaults (EnableRelayV2) handled it
    return "other"


class Run:
    """One bench run in a lab `net` with the four host processes `c`."""

    def __init__(self, args, net, children: dict[int, Child], summary: dict):
        self.args, self.net, self.c, self.s = args, net, children, summary
        self.bench = Bench(children)
        self.relays: dict[str, dict] = {}  # name -> start reply
        self.maddr: dict[str, str] = {}
        self.circuit: dict[str, str] = {}  # a receiver's address through relay r
        self.peers: dict[str, dict] = {}

    def start_nat(self, host: int, name: str, relay: str, flags: dict) -> int:
        return self.c[host].submit("start", name=name, kind="nat", relay=self.maddr[relay],
                                   host_maddrs=[f"/ip4/{self.net.addr(host)}/tcp/0"], extra_flags=flags)

    def nat_result(self, host: int, name: str, relay: str, flags: dict, rid: int) -> dict:
        try:
            return self.c[host].result(rid, CALL_TIMEOUT_S)
        except BenchError as e:  # seen rarely under load: "failed to connect to bootstrap peers"; once more
            self.s["errors"].append(f"{name}: start retried after: {e}"[:300])
            return self.c[host].result(self.start_nat(host, name, relay, flags), CALL_TIMEOUT_S)

    def add_relays(self, plan: list[tuple[str, str]], extra_nat: list[tuple[int, str, dict]] = ()) -> None:
        """Start relays (host 0) and a receiver per relay (host 1), in parallel; extra_nat: more NATed
        instances (host, name, flags) on the first relay of the plan. Then, per relay: the reservation
        time, the first circuit, and the 1 MB probe that shows which limit the relay enforces."""
        net, c = self.net, self.c
        rids = {r: c[0].submit("start", name=f"relay_{r}", kind="relay", host_maddrs=[f"/ip4/{net.addr(0)}/tcp/0"],
                               extra_flags=VARIANTS[v]) for r, v in plan}
        for r, rid in rids.items():
            self.relays[r] = c[0].result(rid, CALL_TIMEOUT_S)
            self.maddr[r] = next(m for m in self.relays[r]["maddrs"] if f"/ip4/{net.addr(0)}/tcp/" in m)
            # autorelay never advertises this here: it keeps only a relay's *public* addresses
            # (go-libp2p autorelay cleanupAddressSet), and the lab is 10.x
            self.circuit[r] = f"{self.maddr[r]}/p2p-circuit"
        starts = [(1, f"recv_{r}", r, NAT_FLAGS) for r, _ in plan] + [(h, n, plan[0][0], f) for h, n, f in extra_nat]
        rids = [(h, n, r, f, self.start_nat(h, n, r, f)) for h, n, r, f in starts]
        for h, n, r, f, rid in rids:
            self.peers[n] = self.nat_result(h, n, r, f, rid)
        reach = {r: c[2].submit("reach", name="send", peer_id=self.peers[f"recv_{r}"]["peer_id"],
                                maddrs=[self.circuit[r]], timeout=CIRCUIT_TIMEOUT_S) for r, _ in plan}
        for r, v in plan:
            got = c[2].result(reach[r], CIRCUIT_TIMEOUT_S + 20)
            recv = self.peers[f"recv_{r}"]
            adv = c[1].call("addrs", 15, name=f"recv_{r}")["maddrs"]
            info = self.s["relays"][r] = {
                "variant": v, "p2pd_flags": self.s["variants"][v], "relay_maddr": self.maddr[r],
                "receiver_create_s": round(recv["create_s"], 2),
                "reachable_after_s": round(got["wall"] - recv["start_wall"], 2) if got["reached"] else None,
                "reach_attempts": got["attempts"], "reach_error": got.get("last_error"),
                "receiver_advertises_circuit": any("p2p-circuit" in m for m in adv)}
            if not got["reached"]:
                self.s["errors"].append(f"relay {r}: receiver not reachable through it in {CIRCUIT_TIMEOUT_S:.0f} s: "
                                        f"{got.get('last_error')}")
                info["limit"] = "no-circuit"
                continue
            probe = self.bench.transfer(2, "send", 1, recv["peer_id"], [self.circuit[r]], PROBE_BYTES,
                                        timeout=_bulk_timeout(PROBE_BYTES, self.args.rate))
            info["probe"] = probe
            info["limit"] = _limit_seen(probe)
            print(f"  relay {r:9} probe {PROBE_BYTES / MB:g} MB: {probe['delivered']:>8} B "
                  f"{'complete' if probe['complete'] else 'CUT'} -> limit {info['limit']}", flush=True)
        time.sleep(0.5)  # the relays log a cut connection's byte counts as it winds down
        log = c[0].call("relay_log", 15)
        sender = self.peers["send"]["peer_id"]
        for r, _ in plan:
            recv = self.peers[f"recv_{r}"]
            info = self.s["relays"][r]
            times = [t for name, peer, t in log["reservations"] if name == f"relay_{r}" and peer == recv["peer_id"]]
            info["reserved_after_s"] = round(min(times) - recv["start_wall"], 2) if times else None
            # the relay's own count for the sender -> receiver direction of each relayed connection
            # that has ended so far (the probe's, if the relay cut it)
            info["relay_counted"] = [n for name, n, src, dst in log["relayed"]
                                     if name == f"relay_{r}" and src == sender and dst == recv["peer_id"]]
            if info.get("limit") == "other" and DEFAULT_DATA_LIMIT in info["relay_counted"]:
                info["limit"] = "128KiB"  # cut at the relay's budget, but less of it reached the handler

    def with_limit(self, limit: str) -> list[str]:
        return [r for r, x in self.s["relays"].items() if x.get("limit") == limit]

    def trickle(self, r: str):
        """1000 B every 2 s for TRICKLE_S through relay r, in the background: ~68 KB on the wire
        stays under 128 KiB, so only a time limit (go-libp2p default 2 min) can cut it."""
        finish = self.bench.transfer(2, "send", 1, self.peers[f"recv_{r}"]["peer_id"], [self.circuit[r]],
                                     TRICKLE_S // 2 * 1000, chunk=1000, interval=2.0, timeout=TRICKLE_S + 40,
                                     background=True)
        return finish, {"relay": r, "chunk": 1000, "interval_s": 2.0, "planned_s": TRICKLE_S}


def run(args) -> dict:
    import netns

    quick = args.quick
    sizes = [1] if quick else [1, 4, 16]
    per_variant = args.relays or (2 if quick else 3)
    extra_batches = 0 if quick else args.extra_batches
    t_start = time.monotonic()
    s: dict = {"rate_mbit": args.rate, "quick": quick, "sizes_mb": sizes,
               "variants": {v: [f"-{k}={x}" for k, x in f.items()] for v, f in VARIANTS.items()},
               "nat_p2pd_flags": [f"-{k}={x}" for k, x in NAT_FLAGS.items()],
               "relays": {}, "relayed": {}, "direct": {}, "errors": []}
    tmp = Path(tempfile.mkdtemp(prefix="relay_bench-"))
    net = None
    children: dict[int, Child] = {}
    try:
        net = netns.Namespaces(4, rate_mbit=args.rate, nat=[1, 2], tag="relay")
        s["lab"] = {"relay": net.addr(0), "receiver": net.addr(1), "receiver_public": net.public_addr(1),
                    "sender": net.addr(2), "sender_public": net.public_addr(2), "direct_sender": net.addr(3)}
        me = str(Path(__file__).resolve())
        for i in range(4):
            children[i] = Child(f"host{i}", net.prefix(i) + [sys.executable, me, "--role", "node"],
                                tmp / f"host{i}.log")
        for ch in children.values():
            ch.result(0, CALL_TIMEOUT_S)  # "ready": hivemind imported
        lab = Run(args, net, children, s)
        t_peers = time.monotonic()
        direct_rid = children[3].submit("start", name="direct", kind="public",
                                        host_maddrs=[f"/ip4/{net.addr(3)}/tcp/0"])
        plan = [(f"{v}{k}", v) for v in VARIANTS for k in range(per_variant)]
        # one sender for all relays (host 2); in the full run also a receiver with hivemind's
        # default -relayDiscovery=1 (host 1), both bootstrapped from the first relay
        extra = [(2, "send", NAT_FLAGS)] + ([] if quick else [(1, "recv_discovery", {})])
        lab.add_relays(plan, extra)
        lab.peers["direct"] = children[3].result(direct_rid, CALL_TIMEOUT_S)
        s["peers_started_s"] = round(time.monotonic() - t_peers, 2)

        background = {}
        if not quick and lab.with_limit("128KiB"):
            background["trickle_128KiB"] = lab.trickle(lab.with_limit("128KiB")[-1])
        # the outcome is a start-up race: more relays until one enforces the raised limits
        batch = 0
        while batch < extra_batches and not lab.with_limit("raised"):
            batch += 1
            lab.add_relays([(f"{v}{per_variant + batch - 1}", v) for v in VARIANTS])
        s["extra_batches"] = batch
        limits = ("raised", "128KiB", "no-circuit", "other")
        s["limits_by_variant"] = {v: {lim: sum(1 for x in s["relays"].values() if x["variant"] == v and
                                               x.get("limit") == lim) for lim in limits} for v in VARIANTS}
        raised = lab.with_limit("raised")
        if not quick and raised:
            background["trickle_raised"] = lab.trickle(raised[-1])

        # bulk through a relay that does not cut (if any), then direct
        relayed = s["relayed"]
        bulk = [r for r in raised if r not in {m["relay"] for _, m in background.values()}] or raised
        relayed["relay"] = bulk[0] if bulk else None
        relayed["transfers"] = [s["relays"][bulk[0]]["probe"]] if bulk else []
        for size in sizes[1:] if bulk else []:
            res = lab.bench.transfer(2, "send", 1, lab.peers[f"recv_{bulk[0]}"]["peer_id"], [lab.circuit[bulk[0]]],
                                     size * MB, timeout=_bulk_timeout(size * MB, args.rate))
            relayed["transfers"].append(res)
            print(f"  relayed via {bulk[0]} {size:3d} MB: {res['delivered']:>10} B "
                  f"{'complete' if res['complete'] else 'CUT'}  {_fmt(res['mb_per_s'])} MB/s", flush=True)
        direct = s["direct"]
        direct["transfers"] = []
        first = plan[0][0]
        for size in sizes:
            res = lab.bench.transfer(3, "direct", 0, lab.relays[first]["peer_id"], [lab.maddr[first]], size * MB,
                                     timeout=_bulk_timeout(size * MB, args.rate))
            direct["transfers"].append(res)
            print(f"  direct {size:3d} MB: {res['delivered']:>10} B {'complete' if res['complete'] else 'CUT'}  "
                  f"{_fmt(res['mb_per_s'])} MB/s", flush=True)
        try:
            tcp = netns.transfer(net, 3, 0, sizes[-1] * MB)
            direct["raw_tcp"] = {"nbytes": tcp["bytes"], "mb_per_s": round(tcp["bytes"] / tcp["seconds"] / MB, 3)}
        except netns.NetnsError as e:
            direct["raw_tcp"] = {"error": str(e)}
        for part in (relayed, direct):
            rates = [t["mb_per_s"] for t in part["transfers"] if t["mb_per_s"]]
            part["best_mb_per_s"] = max(rates) if rates else None

        if not quick:
            # hivemind's default on the NATed side (-relayDiscovery=1): autorelay wants 4 relay
            # candidates (any peer it reaches directly that speaks the hop protocol; every p2pd
            # with -relay=1 does) or its 3-minute boot delay. Watched in the daemons' logs.
            recv = lab.peers["recv_discovery"]
            until = t_peers + TRICKLE_S + 30
            found = []
            while not found and time.monotonic() < until:
                time.sleep(2)
                found = [(h, x) for h in (0, 1, 2) for x in children[h].call("relay_log", 15)["reservations"]
                         if x[1] == recv["peer_id"]]
            s["default_discovery"] = {
                "reserved_after_s": round(found[0][1][2] - recv["start_wall"], 1) if found else None,
                "reserved_at": [f"host{h}:{x[0]}" for h, x in found],
                "watched_s": round(time.monotonic() - t_peers, 1)}
            for key, (finish, meta) in background.items():
                res = finish()
                res.update(meta)
                s[key] = res
        s["wall_s"] = round(time.monotonic() - t_start, 1)
        return s
    finally:
        for ch in children.values():
            ch.stop()
        if net is not None:
            net.close()
        s["teardown"] = {"process_groups_left": _groups_alive([ch.proc.pid for ch in children.values()]),
                         "namespaces_left": [] if net is None else
                         [n for n in netns._list_netns() if n in (net.hub, *net.hosts, *net.routers.values())]}
        if args.keep_logs:
            print(f"logs kept in {tmp}", file=sys.stderr)
        else:
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()


def print_table(s: dict) -> None:
    print(f"\nrelay_bench: {s['rate_mbit']:g} Mbit/s links; relays in public host 0, receiver/sender behind their "
          f"own NATs (hosts 1/2), direct = public host 3 -> host 0")
    print(f"NATed peers: use_auto_relay, trusted_relays=[relay], force private, {' '.join(s['nat_p2pd_flags'])}")
    print("reserve s / reach s: after the receiver's P2P.create began, until the relay granted its reservation / "
          "until the sender first got through to it")
    print("probe B: of 1 MB, what reached the receiver's handler; relay B: what the relay says it relayed "
          "sender -> receiver on that connection before it ended")
    print(f"{'relay':10} {'extra p2pd flags (relay daemon)':55} {'reserve s':>9} {'reach s':>7} {'probe B':>9} "
          f"{'relay B':>8}  limit")
    for r, x in s["relays"].items():
        p = x.get("probe") or {}
        counted = max(x.get("relay_counted") or [0]) or None
        print(f"{r:10} {' '.join(x['p2pd_flags']) or '(none)':55} {_fmt(x.get('reserved_after_s'), '.1f'):>9} "
              f"{_fmt(x['reachable_after_s'], '.1f'):>7} {p.get('delivered', 0):9d} {_fmt(counted, 'd'):>8}  "
              f"{x.get('limit')}")
    print(f"{'path':22} {'MB':>4} {'delivered B':>12} {'MB/s':>7}  result")
    rows = [(f"relayed via {s['relayed'].get('relay')}", t) for t in s["relayed"].get("transfers", [])]
    rows += [("direct", t) for t in s["direct"].get("transfers", [])]
    for name, t in rows:
        why = "" if t["complete"] else f"  ({t['receiver_error'] or t['sender_error']})"
        print(f"{name:22} {t['nbytes'] / MB:4g} {t['delivered']:12d} {_fmt(t['mb_per_s']):>7}  "
              f"{'complete' if t['complete'] else 'CUT'}{why}")
    if not s["relayed"].get("transfers"):
        print("relayed bulk: no relay in this run escaped the 128 KiB limit, so no relayed rate")
    raw = s["direct"].get("raw_tcp", {})
    if "mb_per_s" in raw:
        print(f"{'raw TCP 3->0':22} {raw['nbytes'] / MB:4g} {raw['nbytes']:12d} {raw['mb_per_s']:7.2f}  (no libp2p)")
    for key in ("trickle_128KiB", "trickle_raised"):
        if key in s:
            t = s[key]
            print(f"trickle via {t['relay']}: {t['chunk']} B every {t['interval_s']:g} s for {t['planned_s']} s: "
                  f"{t['delivered']}/{t['nbytes']} B, last byte at {_fmt(t['receiver_seconds'], '.1f')} s, "
                  f"sender saw the reset at {_fmt(t['sender_broke_at_s'], '.1f')} s: "
                  f"{'complete' if t['complete'] else 'CUT'}")
    if "default_discovery" in s:
        d = s["default_discovery"]
        print(f"receiver with hivemind's default -relayDiscovery=1: reservation after "
              f"{_fmt(d['reserved_after_s'], '.1f')} s "
              f"at {', '.join(d['reserved_at']) or 'none'} (watched {d['watched_s']:.0f} s)")
    for e in s["errors"]:
        print(f"error: {e}")
    print(f"wall time {s.get('wall_s')} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["node"], help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="1 MB through each relay + direct, <= ~60 s")
    parser.add_argument("--rate", type=float, default=20.0, help="Mbit/s on every link (default 20)")
    parser.add_argument("--relays", type=int, default=0,
                        help="relay daemons per variant (default 2 with --quick, else 3)")
    parser.add_argument("--extra-batches", type=int, default=3,
                        help="full run: start up to this many more pairs of relays while none enforces the "
                             "raised limits (default 3)")
    parser.add_argument("--json", type=Path, help="also write the JSON summary here")
    parser.add_argument("--keep-logs", action="store_true", help="keep the children's logs (stderr) in a temp dir")
    args = parser.parse_args(argv)
    if args.role == "node":
        return _child_main()

    import netns

    ok, why = netns.available(nat=True)
    if not ok:
        print(f"relay_bench: network namespaces unavailable: {why}")
        return 2
    try:
        summary = run(args)
    except (BenchError, netns.NetnsError) as e:
        print(f"relay_bench: FAILED: {e}", file=sys.stderr)
        return 1
    print_table(summary)
    line = json.dumps(summary)
    if args.json:
        args.json.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
