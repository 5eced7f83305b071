"""scripts/netns.py: a private namespace network with a tbf limit, real TCP through it, and cleanup.

Where namespaces cannot be built (not root, no iproute2, no CAP_SYS_ADMIN) every test checks instead
that the constructor fails with a one-line NetnsError, which is what bench.py relies on to skip."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import netns
from netns import Namespaces, NetnsError, available

AVAILABLE, WHY = available()


def _sh(args: list[str], timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=False, capture_output=True, text=True, timeout=timeout)


def _ours() -> list[str]:
    """Namespaces this test process created that still exist."""
    out = _sh(["ip", "netns", "list"]).stdout
    names = [ln.split()[0] for ln in out.splitlines() if ln.strip()]
    return [n for n in names if n.startswith(netns.NAME_PREFIX) and f"-{os.getpid()}-" in n]


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
    stale = f"{netns.NAME_PREFIX}pytest-{dead}-0-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    try:
        with Namespaces(1, tag="pytest") as a, Namespaces(1, tag="pytest") as b:
            listed = _sh(["ip", "netns", "list"]).stdout
            assert stale not in listed
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
        _sh(["ip", "netns", "delete", stale])
    assert _ours() == []
