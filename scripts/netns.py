#!/usr/bin/env python3
"""A private internet of Linux network namespaces, for benchmarks and tests whose peers should sit
"on different hosts": behind a bandwidth limit, a wide-area delay or a home NAT, with the bytes each
host really put on the wire.

    from netns import Namespaces, NetnsError, available

    ok, why = available()
    if not ok:
        print(f"skipping the netns comparison: {why}")
    else:
        with Namespaces(4, rate_mbit=50, delay_ms=25, nat=[3]) as net:
            server = subprocess.Popen(net.prefix(1) + [sys.executable, "server.py", net.addr(1)])
            ...
            before = net.counters()
            ...                                   # the traffic being measured
            after = net.counters()
            sent = [a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before)]

Layout: host i lives in netns `p2pnet-<tag>-<pid>-<seq>-h<i>` with interface `eth0` (plus `lo`, up).
A public host has eth0 = 10.213.0.(i+1)/24 (SUBNET), and its veth peer `v<i>` is a port of the hub
netns (`...-hub`). A host in `nat` sits in its own home LAN instead: eth0 = 10.214.<i>.2/24, default
route via its router netns `...-r<i>` (`lan` = 10.214.<i>.1, `wan` = 10.213.0.(i+1) on hub port
`v<i>`), which masquerades outgoing connections and drops unsolicited incoming ones (nftables), like
a home router without port forwarding. Public hosts have only the connected /24 route. Nothing is
created in, or routed to, the root namespace.

The hub joins its ports with bridge `br0`; with delay_ms > 0 a userspace delay line does it instead
(a child process with an AF_PACKET socket per port, scripts/delayline.py), holding every frame delay_ms, so
the RTT between any two hosts is 2 * delay_ms. With rate_mbit, a tbf qdisc limits both directions of
every hub link (egress of eth0 or wan = upload, egress of v<i> = download).

Cleanup: close() (also __exit__), an atexit hook and a SIGTERM hook stop the delay line and delete
everything; deleting a namespace destroys the links in it. Names carry the owner's pid, so a run that
was SIGKILLed is cleaned up by the next construction (any user of this module) once that pid is gone;
its delay line ends by itself. Processes started with prefix() are the caller's to stop.

    python scripts/netns.py --selftest           # 2 hosts at 20 Mbit, ~5 MB over TCP
    python scripts/netns.py --selftest-internet  # 2 public + 2 NATed hosts, 20 Mbit, 50 ms one way
                                                 # both: exit 0 ok, 1 bad, 2 unavailable here
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import itertools
import json
import os
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence

__all__ = ["NAME_PREFIX", "NAT_SUBNET", "SUBNET", "Namespaces", "NetnsError", "available", "can_connect",
           "remove_stale", "transfer"]

SUBNET = ipaddress.IPv4Network("10.213.0.0/24")  # RFC 1918, unlikely to shadow anything real
NAT_SUBNET = ipaddress.IPv4Network("10.214.0.0/16")  # host i's home LAN is 10.214.<i>.0/24
NAME_PREFIX = "p2pnet-"
HOST_IF = "eth0"
WAN_IF, LAN_IF = "wan", "lan"  # a home router's two sides
BRIDGE = "br0"
MAX_HOSTS = 250  # .1 .. .250 of SUBNET
MAX_DELAY_MS = 5000.0
CMD_TIMEOUT_S = 15.0  # one `ip`/`tc` call; they normally take milliseconds
TBF_LATENCY_MS = 50  # queue depth of the limiter: enough for TCP to fill the pipe without bufferbloat
START_TIMEOUT_S = 10.0  # a helper process (delay line, listener) must say it is ready within this

_NAME_RE = re.compile(r"^p2pnet-[A-Za-z0-9]+-(\d+)-\d+-(?:hub|h\d+|r\d+)$")
_TAG_RE = re.compile(r"^[A-Za-z0-9]{1,16}$")

# A home router without port forwarding: LAN -> WAN connections leave masqueraded as the WAN address,
# and only their replies come back; anything new from the WAN is dropped (no RST, like most routers).
_ROUTER_RULES = f"""
table ip nat {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "{WAN_IF}" masquerade
    }}
}}
table ip filter {{
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "{WAN_IF}" ct state established,related accept
        iifname "{WAN_IF}" drop
    }}
    chain forward {{
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        ct state invalid drop
        iifname "{LAN_IF}" oifname "{WAN_IF}" accept
    }}
}}
"""


class NetnsError(RuntimeError):
    """Namespaces cannot be built here (not root, no `ip`/`tc`/`nft`, no CAP_SYS_ADMIN) or a command failed."""


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[0] if lines else "(no message)"


def _run(args: list[str], *, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:  # noqa: A002
    stdin = {} if input is not None else {"stdin": subprocess.DEVNULL}
    try:
        proc = subprocess.run(args, check=False, input=input, capture_output=True, text=True,
                              timeout=CMD_TIMEOUT_S, **stdin)
    except FileNotFoundError as e:
        raise NetnsError(f"netns: `{args[0]}` not found ({e.strerror})") from None
    except subprocess.TimeoutExpired:
        raise NetnsError(f"netns: `{' '.join(args)}` did not finish in {CMD_TIMEOUT_S:.0f} s") from None
    if check and proc.returncode != 0:
        raise NetnsError(f"netns: `{' '.join(args)}` failed: {_one_line(proc.stderr or proc.stdout)}")
    return proc


def _precheck(*, nat: bool = False) -> str:
    """Cheap reasons that make namespaces impossible, '' if none."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, e.g. with sudo)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found on PATH (install iproute2)"
    if nat and shutil.which("nft") is None:
        return "`nft` not found on PATH (install nftables; scripts/setup.sh does as root)"
    return ""


def available(*, nat: bool = False) -> tuple[bool, str]:
    """(True, "") if we can create namespaces here (root + ip + tc, and nft if nat), else (False,
    one-line reason).

    Beyond the cheap checks it really creates a scratch namespace with a tbf qdisc (and an nftables
    table if nat), because root in a container often lacks CAP_SYS_ADMIN or the kernel modules."""
    why = _precheck(nat=nat)
    if why:
        return False, why
    probe = f"{NAME_PREFIX}probe-{os.getpid()}-{next(_seq)}-hub"
    try:
        _run(["ip", "netns", "add", probe])
        try:
            _run(["ip", "-n", probe, "link", "set", "lo", "up"])
            _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1mbit",
                  "burst", "16kb", "latency", "50ms"])
            if nat:
                _run(["ip", "netns", "exec", probe, "nft", "-f", "-"], input=_ROUTER_RULES)
        finally:
            _run(["ip", "netns", "delete", probe], check=False)
    except NetnsError as e:
        return False, str(e)
    return True, ""


# ---- process-wide bookkeeping so a crash, exit or SIGTERM never leaks namespaces ----------------

_seq = itertools.count()
_live: set[Namespaces] = set()
_live_lock = threading.RLock()  # reentrant: the SIGTERM hook may run while the main thread is in here
_owner_pid = os.getpid()
_prev_sigterm = None
_sigterm_installed = False
_atexit_registered = False


def _cleanup_all() -> None:
    # a fork()ed child inherits the registry but does not own the namespaces
    if os.getpid() != _owner_pid:
        return
    with _live_lock:
        nets = list(_live)
    for net in nets:
        try:
            net.close()
        except Exception:  # noqa: BLE001, S110 - exit paths must try every instance, and have no one to tell
            pass


def _on_sigterm(signum, frame):
    prev = _prev_sigterm  # read first: the last close() restores and forgets it
    _cleanup_all()
    if callable(prev):
        prev(signum, frame)
        return
    # Default action would kill us without running the owner's `finally` blocks, which usually stop
    # the processes it started inside the namespaces; exit the Python way instead (status 143).
    raise SystemExit(128 + signum)


def _install_hooks() -> None:
    global _atexit_registered, _sigterm_installed, _prev_sigterm
    if not _atexit_registered:
        atexit.register(_cleanup_all)
        _atexit_registered = True
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit/close still cover it
    prev = signal.getsignal(signal.SIGTERM)
    if prev is signal.SIG_IGN:
        return  # the owner chose to survive SIGTERM; so do its namespaces
    _prev_sigterm = prev
    signal.signal(signal.SIGTERM, _on_sigterm)
    _sigterm_installed = True


def _maybe_uninstall_sigterm() -> None:
    global _sigterm_installed, _prev_sigterm
    if not _sigterm_installed or _live or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:  # someone else's later handler stays put
        signal.signal(signal.SIGTERM, _prev_sigterm if _prev_sigterm is not None else signal.SIG_DFL)
    _sigterm_installed = False
    _prev_sigterm = None


def _list_netns() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    # lines look like "name (id: 3)" or just "name"
    return [ln.split()[0] for ln in proc.stdout.splitlines() if ln.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete namespaces of ours whose owning pid is gone (a SIGKILLed run); returns their names."""
    removed = []
    for name in _list_netns():
        m = _NAME_RE.match(name)
        if (m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1)))
                and _run(["ip", "netns", "delete", name], check=False).returncode == 0):
            removed.append(name)
    return removed


# ---- the network --------------------------------------------------------------------------------


class Namespaces:
    """n hosts, each in its own netns, joined by veth pairs to a hub netns (so the root namespace is
    never touched). Host i is public at 10.213.0.(i+1)/24 (SUBNET), or, if i is in `nat`, at
    10.214.<i>.2 behind its own NAT router, whose WAN side takes 10.213.0.(i+1).

    rate_mbit: if set, a `tc qdisc tbf` bandwidth limit on BOTH directions of every link to the hub.
    delay_ms: one-way delay the hub adds to every frame (RTT = 2 * delay_ms; 0 = a plain bridge).
    nat: host indices that sit behind a home NAT: they can connect out to public hosts, nobody can
    connect in to them (neither public hosts nor other NATed ones).

        with Namespaces(4, rate_mbit=50, delay_ms=25, nat=[3]) as net:
            cmd = net.prefix(0) + [sys.executable, "-c", "..."]   # ["ip", "netns", "exec", name, ...]
            net.addr(0)          # "10.213.0.1"
            net.addr(3), net.public_addr(3)   # "10.214.3.2", "10.213.0.4": its own, and what others see
            net.rtt(3, 0)        # ~0.1 s: median TCP connect() time
            net.counters()       # [{"tx_bytes":..., "rx_bytes":...}, ...] per host, from its eth0

    Tuning: the delay line is one Python process; at 20 Mbit it moves ~2-3 kpps and needs a few
    percent of a core, but on a CPU-starved machine its scheduling jitter (ms) adds to the delay.
    TCP reaches the rate through a long delay only with windows >= rate * RTT; the default maximum
    send buffer (net.ipv4.tcp_wmem, 4 MB) covers ~150 Mbit at 100 ms RTT. Beyond that raise it in
    the hosts: `ip netns exec NS sysctl -w net.ipv4.tcp_wmem="4096 16384 33554432"`.
    """

    def __init__(self, n: int, *, rate_mbit: float | None = None, tag: str = "bench", delay_ms: float = 0.0,
                 nat: Iterable[int] = (), rates: Sequence[float | None] | None = None):
        if not isinstance(n, int) or not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"n must be an int in 1..{MAX_HOSTS}, got {n!r}")
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 or None, got {rate_mbit!r}")
        if not _TAG_RE.match(tag):
            raise ValueError(f"tag must be 1-16 letters/digits (it goes into netns names), got {tag!r}")
        if not isinstance(delay_ms, (int, float)) or not 0 <= delay_ms <= MAX_DELAY_MS:
            raise ValueError(f"delay_ms must be a number in 0..{MAX_DELAY_MS:g}, got {delay_ms!r}")
        nat = sorted(set(nat))
        if any(not isinstance(i, int) or not 0 <= i < n for i in nat):
            raise ValueError(f"nat must hold host indices in 0..{n - 1}, got {nat!r}")
        self.n = n
        self.rate_mbit = rate_mbit
        # rates: a limit per host (None = unlimited) instead of rate_mbit on every link
        self.rates = list(rates) if rates is not None else [rate_mbit] * n
        if len(self.rates) != n or any(r is not None and not r > 0 for r in self.rates):
            raise ValueError(f"rates must hold {n} limits > 0 or None, got {rates!r}")
        self.delay_ms = float(delay_ms)
        self.nat = tuple(nat)
        self._closed = True  # until something exists to remove
        self._created: list[str] = []
        self._delay_line: subprocess.Popen | None = None
        why = _precheck(nat=bool(nat))
        if why:
            raise NetnsError(why)

        base = f"{NAME_PREFIX}{tag}-{os.getpid()}-{next(_seq)}"
        self.hub = f"{base}-hub"
        self.hosts = [f"{base}-h{i}" for i in range(n)]
        self.routers = {i: f"{base}-r{i}" for i in self.nat}
        remove_stale()

        with _live_lock:
            _live.add(self)
        self._closed = False
        _install_hooks()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # building -----------------------------------------------------------------------------------

    def _add_netns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        self._add_netns(self.hub)
        if not self.delay_ms:
            _run(["ip", "-n", self.hub, "link", "add", BRIDGE, "type", "bridge"])
            _run(["ip", "-n", self.hub, "link", "set", BRIDGE, "up"])
        for i, host in enumerate(self.hosts):
            self._add_netns(host)
            # the host itself, or its home router, holds public slot i on the hub
            if self.is_nat(i):
                self._add_netns(self.routers[i])
                uplink = (self.routers[i], WAN_IF)
            else:
                uplink = (host, HOST_IF)
            port = f"v{i}"
            _veth(self.hub, port, *uplink)
            if self.delay_ms:
                _run(["ip", "-n", self.hub, "link", "set", port, "addrgenmode", "none", "up"])
            else:
                _run(["ip", "-n", self.hub, "link", "set", port, "master", BRIDGE, "up"])
            _up(*uplink, f"{self.public_addr(i)}/{SUBNET.prefixlen}")
            if self.is_nat(i):
                self._build_home(i)
            if self.rates[i] is not None:
                self._limit(*uplink, self.rates[i])  # upload
                self._limit(self.hub, port, self.rates[i])  # download
        if self.delay_ms:
            self._start_delay_line()

    def _build_home(self, i: int) -> None:
        router, host = self.routers[i], self.hosts[i]
        lan = self._lan(i)
        _veth(router, LAN_IF, host, HOST_IF)
        _up(router, LAN_IF, f"{lan[1]}/{lan.prefixlen}")
        _up(host, HOST_IF, f"{lan[2]}/{lan.prefixlen}")
        _run(["ip", "-n", host, "route", "add", "default", "via", str(lan[1])])
        _run(["ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        _run(["ip", "netns", "exec", router, "nft", "-f", "-"], input=_ROUTER_RULES)

    def _limit(self, ns: str, dev: str, rate_mbit: float) -> None:
        rate_bps = rate_mbit * 1e6 / 8
        # burst >= rate/HZ or tbf cannot reach the rate; >= a few full frames so small rates still
        # pass MTU-sized packets (larger GSO packets are segmented by tbf, not dropped)
        burst = max(int(rate_bps * 0.010), 10 * 1514)
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
              "rate", f"{int(rate_mbit * 1e6)}bit", "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"])

    def _start_delay_line(self) -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        code = (f"import sys; sys.path.insert(0, {here!r}); from delayline import delay_line; "
                "delay_line(float(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])")
        # stdin is a pipe we never write: EOF tells the delay line that we are gone; its own session,
        # so a Ctrl-C meant for us does not take the network down under our cleanup
        self._delay_line = subprocess.Popen(
            ["ip", "netns", "exec", self.hub, sys.executable, "-c", code, str(self.delay_ms / 1000),
             str(os.getpid()), *(f"v{i}" for i in range(self.n))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        _wait_ready(self._delay_line, "ready", "the delay line")

    # public -------------------------------------------------------------------------------------

    def prefix(self, i: int) -> list[str]:
        """argv prefix that runs a command inside host i (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.hosts[self._index(i)]]

    def addr(self, i: int) -> str:
        """The address host i has on its eth0 (a NATed host's LAN address)."""
        if self.is_nat(i):
            return str(self._lan(i)[2])
        return self.public_addr(i)

    def public_addr(self, i: int) -> str:
        """The address host i's connections come from, as others see them (its router's, if NATed)."""
        return str(SUBNET.network_address + self._index(i) + 1)

    def is_nat(self, i: int) -> bool:
        return self._index(i) in self.routers

    def rtt(self, src: int, dst: int, *, port: int = 5301, samples: int = 5) -> float:
        """Seconds: the median of `samples` TCP connect() times (SYN -> SYN/ACK, one round trip) from
        host src to a listener on host dst, after one unmeasured connect that resolves ARP. dst must
        be reachable from src (a public host); NetnsError otherwise."""
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples!r}")
        res = _connects(self, src, dst, self.addr(dst), port=port, samples=samples,
                        timeout=5.0 + 4 * self.delay_ms / 1000)
        if "error" in res:
            raise NetnsError(f"netns: rtt from host {src} to host {dst} ({self.addr(dst)}): {res['error']}")
        return statistics.median(res["seconds"])

    def counters(self) -> list[dict]:
        """Per host {"tx_bytes", "rx_bytes", "tx_packets", "rx_packets"} of its eth0 since creation:
        whole frames (Ethernet + IP + TCP headers + payload), i.e. what the host really put on the wire."""
        if self._closed:
            raise NetnsError("netns: counters() after close()")
        out = []
        for host in self.hosts:
            proc = _run(["ip", "-n", host, "-s", "-j", "link", "show", "dev", HOST_IF])
            try:
                stats = json.loads(proc.stdout)[0]["stats64"]
            except (ValueError, LookupError) as e:
                raise NetnsError(f"netns: unexpected `ip -s -j link` output for {host}: {e!r}") from None
            out.append({"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                        "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"]})
        return out

    def close(self) -> None:
        """Stop the delay line, delete the links and namespaces; idempotent, tolerates things already
        gone, kills nothing the caller started."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._delay_line is not None:
                _stop(self._delay_line)
            # deleting a veth end removes both ends even while some process keeps a host netns alive
            for i in range(self.n):
                if self.hub in self._created:
                    _run(["ip", "-n", self.hub, "link", "delete", f"v{i}"], check=False)
                if self.routers.get(i) in self._created:
                    _run(["ip", "-n", self.routers[i], "link", "delete", LAN_IF], check=False)
            for name in reversed(self._created):
                _run(["ip", "netns", "delete", name], check=False)
        finally:
            with _live_lock:
                _live.discard(self)
            _maybe_uninstall_sigterm()

    def __enter__(self) -> Namespaces:  # noqa: PYI034 - typing.Self needs 3.11, we support 3.10
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"Namespaces(n={self.n}, rate_mbit={self.rate_mbit}, delay_ms={self.delay_ms:g}, "
                f"nat={list(self.nat)}, hub={self.hub!r}, {state})")

    def _index(self, i: int) -> int:
        if not isinstance(i, int) or not 0 <= i < self.n:
            raise IndexError(f"host index {i!r} out of range 0..{self.n - 1}")
        return i

    def _lan(self, i: int) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network((int(NAT_SUBNET.network_address) + (i << 8), 24))


def _veth(ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
    # created straight into both namespaces, so the pair never exists in the root namespace;
    # gso_max_segs 1: one skb = one MTU-sized frame, so the counters include the per-frame
    # headers a real NIC would send (with 64 KB GSO skbs they would undercount them ~4x)
    _run(["ip", "-n", ns_a, "link", "add", dev_a, "gso_max_segs", "1", "type", "veth",
          "peer", "name", dev_b, "netns", ns_b, "gso_max_segs", "1"])


def _up(ns: str, dev: str, cidr: str) -> None:
    # no IPv6 link-local address: no DAD/router-solicitation chatter in the byte counters
    _run(["ip", "-n", ns, "link", "set", dev, "addrgenmode", "none"])
    _run(["ip", "-n", ns, "addr", "add", cidr, "dev", dev])
    _run(["ip", "-n", ns, "link", "set", dev, "up"])


# ---- real TCP between hosts: transfer, connect times, reachability (selftests and tests) --------

_SERVER = r"""
import json, socket, sys, time
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port))
srv.listen(1)
srv.settimeout(timeout)
conn, peer = srv.accept()
conn.settimeout(timeout)
t0 = time.monotonic()
n = 0
while True:
    b = conn.recv(1 << 16)
    if not b:
        break
    n += len(b)
t1 = time.monotonic()
conn.close()
print(json.dumps({"bytes": n, "seconds": t1 - t0, "peer": peer[0]}), flush=True)
"""

_CLIENT = r"""
import socket, sys, time
host, port, nbytes, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
deadline = time.monotonic() + timeout
while True:  # the server may still be starting
    try:
        s = socket.create_connection((host, port), timeout=timeout)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
chunk = b"\0" * (1 << 16)
left = nbytes
while left > 0:
    s.sendall(chunk[:min(left, len(chunk))])
    left -= min(left, len(chunk))
s.shutdown(socket.SHUT_WR)
while s.recv(1 << 16):  # EOF once the server has read everything
    pass
s.close()
"""

_LISTENER = r"""
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1])))
srv.listen(128)
print("listening", flush=True)
while True:
    srv.accept()[0].close()
"""

_CONNECTOR = r"""
import json, socket, sys, time
host, port, samples, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
times = []
for _ in range(1 + samples):  # the first one also waits for ARP along the path: not measured
    s = socket.socket()
    s.settimeout(timeout)
    t0 = time.perf_counter()
    try:
        s.connect((host, port))
    except OSError as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        sys.exit(0)
    times.append(time.perf_counter() - t0)
    s.close()
print(json.dumps({"seconds": times[1:]}))
"""


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else "(no message)"


def _wait_ready(proc: subprocess.Popen, word: str, what: str, timeout: float = START_TIMEOUT_S) -> None:
    """Wait until proc prints `word` on stdout; else stop it and raise NetnsError with its last words."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if ready and proc.stdout.readline().strip() == word:
        return
    if proc.poll() is None:
        proc.kill()
    err = proc.stderr.read() if proc.stderr is not None else ""  # EOF once it is dead
    _stop(proc)
    raise NetnsError(f"netns: {what} did not start: "
                     + (_last_line(err) if err.strip() else f"no `{word}` in {timeout:.0f} s, rc={proc.returncode}"))


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def transfer(net: Namespaces, src: int, dst: int, nbytes: int, *, port: int = 5201,
             timeout: float = 30.0) -> dict:
    """Send nbytes over TCP from host src to host dst; {"bytes", "seconds", "mbit", "peer"} as the
    receiver saw them (accept to EOF, so sender-side buffering does not inflate the rate; peer = the
    address the connection came from, net.public_addr(src))."""
    server = subprocess.Popen(net.prefix(dst) + [sys.executable, "-c", _SERVER, net.addr(dst), str(port), str(timeout)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client = None
    try:
        client = subprocess.Popen(
            net.prefix(src) + [sys.executable, "-c", _CLIENT, net.addr(dst), str(port), str(nbytes), str(timeout)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            out, err = server.communicate(timeout=timeout + 10)
            _, cerr = client.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            raise NetnsError(f"netns: transfer of {nbytes} bytes did not finish in {timeout + 10:.0f} s") from None
        if server.returncode != 0 or client.returncode != 0:
            raise NetnsError(f"netns: transfer failed: server rc={server.returncode} {_one_line(err)!r}, "
                             f"client rc={client.returncode} {_one_line(cerr)!r}")
        res = json.loads(out)
        res["mbit"] = res["bytes"] * 8 / max(res["seconds"], 1e-9) / 1e6
        return res
    finally:
        for proc in (client, server):
            if proc is not None:
                _stop(proc)


def _connects(net: Namespaces, src: int, dst: int, addr: str, *, port: int, samples: int,
              timeout: float) -> dict:
    """1 + samples TCP connects from host src to addr:port while host dst listens on that port:
    {"seconds": [connect times but the first]}, or {"error": "..."} from the first that failed."""
    listener = subprocess.Popen(net.prefix(dst) + [sys.executable, "-c", _LISTENER, str(port)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(listener, "listening", f"a listener on host {dst} port {port}")
        limit = (1 + samples) * timeout + 10
        try:
            proc = subprocess.run(
                net.prefix(src) + [sys.executable, "-c", _CONNECTOR, addr, str(port), str(samples), str(timeout)],
                check=False, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            raise NetnsError(f"netns: connects from host {src} to {addr}:{port} did not end in {limit:.0f} s") from None
        if proc.returncode != 0:
            raise NetnsError(f"netns: connects from host {src} failed: {_last_line(proc.stderr)}")
        return json.loads(proc.stdout)
    finally:
        _stop(listener)


def can_connect(net: Namespaces, src: int, dst: int, *, addr: str | None = None, port: int = 5302,
                timeout: float = 2.0) -> bool:
    """Whether host src can open a TCP connection to a listener on host dst, dialing addr (default
    net.addr(dst); e.g. net.public_addr(dst) to knock on a NATed host's router) within timeout s."""
    res = _connects(net, src, dst, addr or net.addr(dst), port=port, samples=0, timeout=timeout)
    return "error" not in res


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _selftest(rate_mbit: float = 20.0, nbytes: int = 5_000_000) -> int:
    ok, why = available()
    if not ok:
        print(f"netns selftest: unavailable: {why}")
        return 2
    t0 = time.monotonic()
    with Namespaces(2, rate_mbit=rate_mbit, tag="selftest") as net:
        print(f"built {net!r} in {time.monotonic() - t0:.2f} s; hosts {net.addr(0)}, {net.addr(1)}")
        before = net.counters()
        res = transfer(net, 0, 1, nbytes)
        after = net.counters()
    gone = [name for name in _list_netns() if name in (net.hub, *net.hosts)]
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    print(f"host0 (sender)  : {delta[0]}")
    print(f"host1 (receiver): {delta[1]}")
    ratio = res["mbit"] / rate_mbit
    print(f"received {res['bytes']} bytes in {res['seconds']:.2f} s = {res['mbit']:.2f} Mbit/s payload "
          f"({ratio:.2f}x the {rate_mbit:g} Mbit/s limit; wire overhead {delta[0]['tx_bytes'] / nbytes - 1:.1%})")
    problems = []
    if res["bytes"] != nbytes:
        problems.append(f"received {res['bytes']} of {nbytes} bytes")
    if not 0.5 <= ratio <= 1.3:
        problems.append(f"rate {ratio:.2f}x the limit, expected 0.5x..1.3x")
    if delta[0]["tx_bytes"] < nbytes or delta[1]["rx_bytes"] < nbytes:
        problems.append("counters grew by less than the payload")
    if gone:
        problems.append(f"namespaces left after close(): {gone}")
    print("netns selftest: " + ("OK" if not problems else "FAILED: " + "; ".join(problems)))
    return 0 if not problems else 1


def _selftest_internet(rate_mbit: float = 20.0, delay_ms: float = 50.0, nbytes: int = 3_000_000) -> int:
    ok, why = available(nat=True)
    if not ok:
        print(f"netns internet selftest: unavailable: {why}")
        return 2
    problems = []
    t0 = time.monotonic()
    with Namespaces(4, rate_mbit=rate_mbit, delay_ms=delay_ms, nat=[2, 3], tag="selftest") as net:
        print(f"built {net!r} in {time.monotonic() - t0:.2f} s")
        print("hosts: " + ", ".join(f"{i}={net.addr(i)}" + (f" (NAT, seen as {net.public_addr(i)})" * net.is_nat(i))
                                    for i in range(net.n)))
        rtts = {"public<->public": net.rtt(0, 1), "NAT->public": net.rtt(2, 0)}
        cpu0, t1 = _cpu_seconds(net._delay_line.pid), time.monotonic()
        rates = {"NAT->public": transfer(net, 2, 0, nbytes), "public->public": transfer(net, 0, 1, nbytes)}
        cpu = (_cpu_seconds(net._delay_line.pid) - cpu0) / (time.monotonic() - t1)
        knocks = {"NAT->NAT by LAN addr": can_connect(net, 2, 3, timeout=1.0),
                  "NAT->NAT by router addr": can_connect(net, 2, 3, addr=net.public_addr(3), timeout=1.0),
                  "public->NAT by LAN addr": can_connect(net, 0, 2, timeout=1.0),
                  "public->NAT by router addr": can_connect(net, 0, 2, addr=net.public_addr(2), timeout=1.0)}
    lo, hi = 1.8 * delay_ms / 1000, 2 * delay_ms / 1000 + 0.06
    for what, rtt in rtts.items():
        print(f"RTT {what:16}: {rtt * 1000:6.1f} ms")
        if not lo <= rtt <= hi:
            problems.append(f"RTT {what} {rtt * 1000:.1f} ms, expected {lo * 1000:.0f}..{hi * 1000:.0f}")
    for what, res in rates.items():
        ratio = res["mbit"] / rate_mbit
        print(f"rate {what:15}: {res['mbit']:6.2f} Mbit/s ({ratio:.2f}x the limit), seen from {res['peer']}")
        if res["bytes"] != nbytes or not 0.5 <= ratio <= 1.3:
            problems.append(f"{what}: {res['bytes']} bytes at {ratio:.2f}x the limit, expected all at 0.5x..1.3x")
    if rates["NAT->public"]["peer"] != net.public_addr(2):
        problems.append(f"NAT->public came from {rates['NAT->public']['peer']}, not the router {net.public_addr(2)}")
    print(f"delay line CPU during the transfers: {cpu:.0%} of a core")
    for what, connected in knocks.items():
        print(f"connect {what:26}: {'CONNECTED' if connected else 'refused'}")
        if connected:
            problems.append(f"{what} connected")
    left = [name for name in _list_netns() if name in (net.hub, *net.hosts, *net.routers.values())]
    if left:
        problems.append(f"namespaces left after close(): {left}")
    if net._delay_line.poll() is None:
        problems.append("the delay line still runs after close()")
    print("netns internet selftest: " + ("OK" if not problems else "FAILED: " + "; ".join(problems)))
    return 0 if not problems else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--selftest", action="store_true",
                        help="2 hosts at 20 Mbit, ~5 MB over TCP; exit 0 ok, 1 failed, 2 unavailable here")
    parser.add_argument("--selftest-internet", action="store_true",
                        help="2 public + 2 NATed hosts at 20 Mbit with 50 ms one-way delay: RTTs, rates, "
                             "and that nobody can connect in to a NATed host; exit 0 ok, 1 failed, 2 unavailable")
    parser.add_argument("--cleanup", action="store_true",
                        help="delete leftover namespaces of dead runs and exit")
    args = parser.parse_args(argv)
    if args.cleanup:
        why = _precheck()
        if why:
            print(f"netns: {why}")
            return 2
        print("\n".join(remove_stale()) or "nothing stale")
        return 0
    if args.selftest:
        return _selftest()
    if args.selftest_internet:
        return _selftest_internet()
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
