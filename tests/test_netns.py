"""scripts/netns.py: a private namespace network with a tbf limit, home NATs and a delay line, real
TCP through it, and cleanup.

Where namespaces cannot be built (not root, no iproute2, no CAP_SYS_ADMIN; no nft for the NAT test)
every test checks instead that the constructor fails with a one-line NetnsError, which is what
bench.py relies on to skip."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import netns
from netns import Namespaces, NetnsError, available

AVAILABLE, WHY = available()
NAT_AVAILABLE, NAT_WHY = available(nat=True) if AVAILABLE else (False, WHY)


def _sh(args: list[str], timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=False, capture_output=True, text=True, timeout=timeout)


def _ours() -> list[str]:
    """Namespaces this test process created that still exist."""
    out = _sh(["ip", "netns", "list"]).stdout
    names = [ln.split()[0] for ln in out.splitlines() if ln.strip()]
    return [n for n in names if n.startswith(netns.NAME_PREFIX) and f"-{os.getpid()}-" in n]


def _children() -> set[int]:
    """Live or unreaped child processes of this test process."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2:].split()[1]) == os.getpid():
                pids.add(int(entry))
    return pids


def _assert_one_line_error(**kwargs) -> None:
    with pytest.raises(NetnsError) as info:
        Namespaces(2, **kwargs)
    msg = str(info.value)
    assert msg and "\n" not in msg, repr(msg)


@pytest.mark.timeout(30)
def test_unavailable_gives_one_line_error(monkeypatch):
    if not AVAILABLE:
        assert WHY and "\n" not in WHY, repr(WHY)
        _assert_one_line_error(rate_mbit=20)
        return
    # namespaces work here: fake the two usual reasons they would not
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    ok, why = available()
    assert not ok and "root" in why and "\n" not in why, why
    _assert_one_line_error(rate_mbit=20)
    monkeypatch.undo()

    monkeypatch.setenv("PATH", "/nonexistent")
    ok, why = available()
    assert not ok and "`ip`" in why and "\n" not in why, why
    _assert_one_line_error()
    monkeypatch.undo()
    assert _ours() == []


@pytest.mark.timeout(60)
def test_limited_transfer_counters_and_cleanup():
    if not AVAILABLE:
        _assert_one_line_error(rate_mbit=20)
        return
    rate, payload = 20.0, 3_000_000
    t0 = time.monotonic()
    with Namespaces(2, rate_mbit=rate, tag="pytest") as net:
        assert net.addr(0) == "10.213.0.1" and net.addr(1) == "10.213.0.2"
        assert net.prefix(1)[:3] == ["ip", "netns", "exec"] and net.prefix(1)[3] in _ours()
        assert len(_ours()) == 3  # two hosts + hub
        before = net.counters()
        res = netns.transfer(net, 0, 1, payload)
        after = net.counters()
    assert res["bytes"] == payload, res
    sent = after[0]["tx_bytes"] - before[0]["tx_bytes"]
    received = after[1]["rx_bytes"] - before[1]["rx_bytes"]
    assert sent >= payload and received >= payload, (before, after)
    assert sent < payload * 1.10, (sent, payload)  # headers, not a second copy of the data
    assert res["mbit"] < 1.5 * rate, res
    assert _ours() == [], _ours()
    net.close()  # idempotent
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(30)
def test_loopback_isolation_unique_names_and_stale_cleanup():
    if not AVAILABLE:
        _assert_one_line_error()
        return
    # a namespace left by a SIGKILLed run: our naming, a pid that does not exist
    dead = next(p for p in range(4_000_000, 3_000_000, -1) if not os.path.exists(f"/proc/{p}"))
    stale = [f"{netns.NAME_PREFIX}pytest-{dead}-0-h0", f"{netns.NAME_PREFIX}pytest-{dead}-0-r1"]
    for name in stale:
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        with Namespaces(1, tag="pytest") as a, Namespaces(1, tag="pytest") as b:
            listed = _sh(["ip", "netns", "list"]).stdout
            assert not any(name in listed for name in stale), listed
            assert a.hosts[0] != b.hosts[0] and str(os.getpid()) in a.hosts[0]
            probe = ("import socket\n"
                     "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n"
                     "c = socket.create_connection(s.getsockname(), timeout=5)\n"
                     "try:\n"
                     "    socket.create_connection(('1.1.1.1', 53), timeout=2); print('escaped')\n"
                     "except OSError:\n"
                     "    print('isolated')\n")
            out = _sh(a.prefix(0) + [sys.executable, "-c", probe], timeout=20)
            assert out.returncode == 0 and out.stdout.strip() == "isolated", (out.stdout, out.stderr)
            routes = _sh(a.prefix(0) + ["ip", "-4", "route"]).stdout
            assert "default" not in routes and str(netns.SUBNET) in routes, routes
    finally:
        for name in stale:
            _sh(["ip", "netns", "delete", name])
    assert _ours() == []


def test_argument_checks():
    with pytest.raises(ValueError, match="nat"):
        Namespaces(2, nat=[2])
    with pytest.raises(ValueError, match="delay_ms"):
        Namespaces(2, delay_ms=-1)


@pytest.mark.timeout(40)
def test_nat_lets_connections_out_and_none_in():
    if not NAT_AVAILABLE:
        assert NAT_WHY and "\n" not in NAT_WHY, repr(NAT_WHY)
        _assert_one_line_error(nat=[1])
        return
    t0 = time.monotonic()
    children = _children()
    with Namespaces(3, nat=[1, 2], tag="pytest") as net:  # host 0 public, hosts 1 and 2 each at home
        assert len(_ours()) == 6  # hub, three hosts, two routers
        assert [net.is_nat(i) for i in range(3)] == [False, True, True]
        assert net.addr(0) == net.public_addr(0) == "10.213.0.1"
        assert (net.addr(1), net.public_addr(1)) == ("10.214.1.2", "10.213.0.2")
        assert (net.addr(2), net.public_addr(2)) == ("10.214.2.2", "10.213.0.3")
        routes = _sh(net.prefix(0) + ["ip", "-4", "route"]).stdout
        assert "10.214." not in routes and "default" not in routes, routes

        res = netns.transfer(net, 1, 0, 200_000)
        assert res["bytes"] == 200_000 and res["peer"] == net.public_addr(1), res  # masqueraded
        assert netns.can_connect(net, 2, 0, timeout=1.0)
        for src, dst, addr in [(0, 1, net.addr(1)), (0, 1, net.public_addr(1)),  # nobody gets in...
                               (1, 2, net.addr(2)), (1, 2, net.public_addr(2)),  # ...not even a neighbour
                               (2, 1, net.public_addr(1))]:
            assert not netns.can_connect(net, src, dst, addr=addr, timeout=1.0), (src, dst, addr)
    assert _ours() == [], _ours()
    assert _children() <= children
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(40)
def test_delay_line_sets_the_round_trip_time():
    if not AVAILABLE:
        _assert_one_line_error(delay_ms=50)
        return
    t0 = time.monotonic()
    children = _children()
    with Namespaces(2, delay_ms=50, tag="pytest") as net:
        assert len(_children() - children) == 1  # the delay line
        rtt = net.rtt(0, 1)
        assert 0.09 <= rtt <= 0.16, rtt
    assert _children() <= children  # the delay line is stopped and reaped
    with Namespaces(2, tag="pytest") as net:
        rtt = net.rtt(1, 0)
        assert rtt < 0.02, rtt
    assert _ours() == [], _ours()
    assert time.monotonic() - t0 < 15


@pytest.mark.timeout(40)
def test_delay_line_keeps_the_rate():
    if not AVAILABLE:
        _assert_one_line_error(rate_mbit=20, delay_ms=50)
        return
    rate, payload = 20.0, 3_000_000
    t0 = time.monotonic()
    with Namespaces(2, rate_mbit=rate, delay_ms=50, tag="pytest") as net:
        res = netns.transfer(net, 0, 1, payload)
    assert res["bytes"] == payload, res
    assert 0.5 * rate <= res["mbit"] <= 1.3 * rate, res  # TCP through a 100 ms RTT still fills the pipe
    assert _ours() == [], _ours()
    assert time.monotonic() - t0 < 15
