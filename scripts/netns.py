#!/usr/bin/env python3
"""A private test network of Linux network namespaces, for benchmarks whose peers should sit "on
different hosts" behind a bandwidth limit, with the bytes each host really put on the wire.

    from netns import Namespaces, NetnsError, available

    ok, why = available()
    if not ok:
        print(f"skipping the netns comparison: {why}")
    else:
        with Namespaces(4, rate_mbit=50) as net:
            server = subprocess.Popen(net.prefix(1) + [sys.executable, "server.py", net.addr(1)])
            ...
            before = net.counters()
            ...                                   # the traffic being measured
            after = net.counters()
            sent = [a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before)]

Layout: host i lives in netns `p2pnet-<tag>-<pid>-<seq>-h<i>` with interface `eth0` = 10.213.0.(i+1)/24
(plus `lo`, up). Its veth peer `v<i>` is a port of bridge `br0` in a separate hub netns
(`...-hub`), so nothing is created in, or routed to, the root namespace: hosts have only the
connected /24 route and can reach each other and nothing else. With rate_mbit, a tbf qdisc limits
both directions of every host link (egress of eth0 = upload, egress of v<i> = download).

Cleanup: close() (also __exit__), an atexit hook and a SIGTERM hook delete everything; deleting a
namespace destroys the links in it. Names carry the owner's pid, so a run that was SIGKILLed is
cleaned up by the next construction (any user of this module) once that pid is gone.
Processes started with prefix() are the caller's to stop; close() kills nothing.

    python scripts/netns.py --selftest     # 2 hosts at 20 Mbit, ~5 MB over TCP; exit 0 ok, 1 bad, 2 unavailable
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

__all__ = ["NAME_PREFIX", "SUBNET", "Namespaces", "NetnsError", "available", "remove_stale", "transfer"]

SUBNET = ipaddress.IPv4Network("10.213.0.0/24")  # RFC 1918, unlikely to shadow anything real
NAME_PREFIX = "p2pnet-"
HOST_IF = "eth0"
BRIDGE = "br0"
MAX_HOSTS = 250  # .1 .. .250 of SUBNET
CMD_TIMEOUT_S = 15.0  # one `ip`/`tc` call; they normally take milliseconds
TBF_LATENCY_MS = 50  # queue depth of the limiter: enough for TCP to fill the pipe without bufferbloat

_NAME_RE = re.compile(r"^p2pnet-[A-Za-z0-9]+-(\d+)-\d+-(?:hub|h\d+)$")
_TAG_RE = re.compile(r"^[A-Za-z0-9]{1,16}$")


class NetnsError(RuntimeError):
    """Namespaces cannot be built here (not root, no `ip`/`tc`, no CAP_SYS_ADMIN) or a command failed."""


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[0] if lines else "(no message)"


def _run(args: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(args, check=False, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=CMD_TIMEOUT_S)
    except FileNotFoundError as e:
        raise NetnsError(f"netns: `{args[0]}` not found ({e.strerror})") from None
    except subprocess.TimeoutExpired:
        raise NetnsError(f"netns: `{' '.join(args)}` did not finish in {CMD_TIMEOUT_S:.0f} s") from None
    if check and proc.returncode != 0:
        raise NetnsError(f"netns: `{' '.join(args)}` failed: {_one_line(proc.stderr or proc.stdout)}")
    return proc


def _precheck() -> str:
    """Cheap reasons that make namespaces impossible, '' if none."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, e.g. with sudo)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found on PATH (install iproute2)"
    return ""


def available() -> tuple[bool, str]:
    """(True, "") if we can create namespaces here (root + ip + tc), else (False, one-line reason).

    Beyond the cheap checks it really creates a scratch namespace with a tbf qdisc, because root in
    a container often lacks CAP_SYS_ADMIN or the sch_tbf module."""
    why = _precheck()
    if why:
        return False, why
    probe = f"{NAME_PREFIX}probe-{os.getpid()}-{next(_seq)}-hub"
    try:
        _run(["ip", "netns", "add", probe])
        try:
            _run(["ip", "-n", probe, "link", "set", "lo", "up"])
            _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1mbit",
                  "burst", "16kb", "latency", "50ms"])
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
    """n hosts, each in its own netns, joined by veth pairs to a Linux bridge that lives in its own
    hub netns (so the root namespace is never touched). Host i has address 10.213.0.(i+1)/24 (SUBNET).

    rate_mbit: if set, a `tc qdisc tbf` bandwidth limit on BOTH directions of every host's link
    (egress of the host-side veth and egress of the bridge-side veth).

        with Namespaces(4, rate_mbit=50) as net:
            cmd = net.prefix(0) + [sys.executable, "-c", "..."]   # ["ip", "netns", "exec", name, ...]
            net.addr(0)          # "10.213.0.1"
            net.counters()       # [{"tx_bytes":..., "rx_bytes":...}, ...] per host, from the host-side veth
    """

    def __init__(self, n: int, *, rate_mbit: float | None = None, tag: str = "bench"):
        if not isinstance(n, int) or not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"n must be an int in 1..{MAX_HOSTS}, got {n!r}")
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 or None, got {rate_mbit!r}")
        if not _TAG_RE.match(tag):
            raise ValueError(f"tag must be 1-16 letters/digits (it goes into netns names), got {tag!r}")
        self.n = n
        self.rate_mbit = rate_mbit
        self._closed = True  # until something exists to remove
        self._created: list[str] = []
        why = _precheck()
        if why:
            raise NetnsError(why)

        base = f"{NAME_PREFIX}{tag}-{os.getpid()}-{next(_seq)}"
        self.hub = f"{base}-hub"
        self.hosts = [f"{base}-h{i}" for i in range(n)]
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

    def _build(self) -> None:
        self._add_netns(self.hub)
        _run(["ip", "-n", self.hub, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", self.hub, "link", "set", BRIDGE, "up"])
        for i, host in enumerate(self.hosts):
            self._add_netns(host)
            port = f"v{i}"
            # created straight into both namespaces, so the pair never exists in the root namespace;
            # gso_max_segs 1: one skb = one MTU-sized frame, so the counters include the per-frame
            # headers a real NIC would send (with 64 KB GSO skbs they would undercount them ~4x)
            _run(["ip", "-n", self.hub, "link", "add", port, "gso_max_segs", "1", "type", "veth",
                  "peer", "name", HOST_IF, "netns", host, "gso_max_segs", "1"])
            _run(["ip", "-n", self.hub, "link", "set", port, "master", BRIDGE, "up"])
            _run(["ip", "-n", host, "link", "set", "lo", "up"])
            # no IPv6 link-local address: no DAD/router-solicitation chatter in the byte counters
            _run(["ip", "-n", host, "link", "set", HOST_IF, "addrgenmode", "none"])
            _run(["ip", "-n", host, "addr", "add", f"{self.addr(i)}/{SUBNET.prefixlen}", "dev", HOST_IF])
            _run(["ip", "-n", host, "link", "set", HOST_IF, "up"])
            if self.rate_mbit is not None:
                self._limit(host, HOST_IF)  # host upload
                self._limit(self.hub, port)  # host download

    def _limit(self, ns: str, dev: str) -> None:
        rate_bps = self.rate_mbit * 1e6 / 8
        # burst >= rate/HZ or tbf cannot reach the rate; >= a few full frames so small rates still
        # pass MTU-sized packets (larger GSO packets are segmented by tbf, not dropped)
        burst = max(int(rate_bps * 0.010), 10 * 1514)
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
              "rate", f"{int(self.rate_mbit * 1e6)}bit", "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"])

    # public -------------------------------------------------------------------------------------

    def prefix(self, i: int) -> list[str]:
        """argv prefix that runs a command inside host i (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.hosts[self._index(i)]]

    def addr(self, i: int) -> str:
        return str(SUBNET.network_address + self._index(i) + 1)

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
        """Delete the links and namespaces; idempotent, tolerates things already gone, kills nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            # deleting a veth end removes both ends even while some process keeps a host netns alive
            for i in range(self.n):
                if self.hub in self._created:
                    _run(["ip", "-n", self.hub, "link", "delete", f"v{i}"], check=False)
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
        return f"Namespaces(n={self.n}, rate_mbit={self.rate_mbit}, hub={self.hub!r}, {state})"

    def _index(self, i: int) -> int:
        if not isinstance(i, int) or not 0 <= i < self.n:
            raise IndexError(f"host index {i!r} out of range 0..{self.n - 1}")
        return i


# ---- a real TCP transfer between two hosts (selftest and tests) ---------------------------------

_SERVER = r"""
import json, socket, sys, time
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port))
srv.listen(1)
srv.settimeout(timeout)
conn, _ = srv.accept()
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
print(json.dumps({"bytes": n, "seconds": t1 - t0}), flush=True)
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


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def transfer(net: Namespaces, src: int, dst: int, nbytes: int, *, port: int = 5201,
             timeout: float = 30.0) -> dict:
    """Send nbytes over TCP from host src to host dst; {"bytes", "seconds", "mbit"} as the receiver
    saw them (accept to EOF, so sender-side buffering does not inflate the rate)."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--selftest", action="store_true",
                        help="2 hosts at 20 Mbit, ~5 MB over TCP; exit 0 ok, 1 failed, 2 unavailable here")
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
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
