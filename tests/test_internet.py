"""Issue 10's scenarios at the suite's size: real `p2pdiloco join` peers on namespaces with NAT
routers, a bandwidth limit and a 100 ms delay line (scripts/internet.py; full size in
docs/network.md). Where namespaces or nftables are missing the scenario script must say why on
one line and exit 2 — that is asserted instead, never skipped."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import internet  # noqa: E402
from netns import available  # noqa: E402

NAT_OK, WHY = available(nat=True)


def _assert_refused(scenario: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "internet.py"), scenario, "--quick"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert WHY in proc.stderr


@pytest.mark.timeout(300)
def test_nated_peers_average_with_public_ones(tmp_path, corpus):
    if not NAT_OK:
        _assert_refused("nat")
        return
    r = internet.nat(tmp_path / "nat", duration=60, data=str(corpus))
    assert r["exit_codes"] == {"a": 0, "b": 0, "c": 0, "d": 0}, r
    peers = r["peers"]
    # c found out by itself that nobody can dial it; d was told; b was dialed back by a
    assert peers["c"]["reachability"] == "client" and peers["d"]["reachability"] == "client", r
    assert peers["b"]["reachability"] == "direct", r
    said = r["said"]  # and each told its user, in the words of the startup paragraph
    assert said["c"].startswith("p2pdiloco: NOT reachable: ") and "tried to dial us" in said["c"], said
    assert said["d"].startswith("p2pdiloco: client mode"), said
    assert said["b"].startswith("p2pdiloco: reachable: ") and "dialed us back" in said["b"], said
    assert said["a"].startswith("p2pdiloco: reachability unknown"), said
    # the suite's size is short and shares 2 cores with 4 peers: looser than the 5-minute targets
    assert all(v >= 0.5 for v in r["applied_vs_best_public"].values()), r
    assert r["share_rounds_all_four"] >= 0.25, r
    assert peers["c"]["group_sizes"].get("4", 0) >= 1 and peers["d"]["group_sizes"].get("4", 0) >= 1, r
    assert not any(r["tracebacks"].values()), r


@pytest.mark.timeout(300)
def test_slow_links_rounds_join_and_a_crash(tmp_path, corpus):
    if not NAT_OK:
        _assert_refused("slow")
        return
    r = internet.slow(tmp_path / "slow", duration=60, data=str(corpus))
    assert 0.09 <= r["rtt_s"] <= 0.16, r
    assert r["exit_codes"] == {"a": 0, "b": 0, "d": 0}, r
    assert r["join_download_s"] is not None and r["join_loaded_outer_step"] >= 1, r
    assert r["peers"]["a"]["round_s_median"] <= 2.0 + 3.0, r  # matchmaking window + 3 s
    assert all(v >= 1 for v in r["applied_after_kill"].values()), r
    assert not any(r["tracebacks"].values()), r
