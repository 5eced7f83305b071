"""scripts/relay_bench.py --quick: two NATed peers reach each other through public relays (libp2p
circuit relay v2) in network namespaces; each relay either cuts a 1 MB stream at go-libp2p's 128 KiB
budget or carries it whole, and a direct public->public transfer completes at the link rate. Where
namespaces cannot be built, the script must say so in one line and exit 2 (asserted, not skipped)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import netns  # noqa: E402

pytestmark = pytest.mark.timeout(200)

RATE_MBIT = 20.0
PER_VARIANT = 2  # --quick: 2 relays per variant
DEFAULT_DATA_LIMIT = 1 << 17  # go-libp2p circuit v2: 128 KiB per direction per relayed connection


def test_relay_bench_quick(tmp_path):
    ok, why = netns.available(nat=True)
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "relay_bench.py"), "--quick",
                           "--rate", str(RATE_MBIT), "--json", str(out)], check=False, capture_output=True, text=True,
                          timeout=150)
    if not ok:
        assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("relay_bench: network namespaces unavailable"), proc.stdout
        assert why in lines[0]
        return

    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s == json.loads(out.read_text())
    assert s["quick"] is True and s["rate_mbit"] == RATE_MBIT and s["sizes_mb"] == [1]
    assert s["variants"]["default"] == [] and "-relayDataLimit=4294967296" in s["variants"]["flags"]
    assert s["nat_p2pd_flags"] == ["-relayDiscovery=0"]
    assert s["teardown"] == {"process_groups_left": [], "namespaces_left": []}, s["teardown"]

    # every relay: a reservation, a circuit, and a 1 MB probe that either went whole or was cut where
    # the relay had counted exactly its 128 KiB budget (its own log says so). Under heavy load a probe
    # was once seen cut early for reasons not pinned down: one such "other" of the four is tolerated.
    relays = s["relays"]
    assert sorted(relays) == sorted(f"{v}{k}" for v in ("default", "flags") for k in range(PER_VARIANT)), relays
    others = [name for name, r in relays.items() if r["limit"] == "other"]
    assert len(others) <= 1 and all(r["limit"] in ("raised", "128KiB", "other") for r in relays.values()), relays
    for name, r in relays.items():
        assert 0 < r["reserved_after_s"] < 45 and 0 < r["reachable_after_s"] < 60, (name, r)
        assert r["receiver_advertises_circuit"] is False  # autorelay drops the relay's private (10.x) addrs
        probe = r["probe"]
        assert probe["relayed"] and all("/p2p-circuit" in a for a in probe["path"]), (name, probe)
        assert probe["nbytes"] == 1_000_000
        # a relay that cut at its budget can reset the stream before the receiver's handler got a byte of it
        # (CI at 61c21ae: the relay counted 131072, the receiver 0 and still waiting): the relay's count says it
        cut = DEFAULT_DATA_LIMIT in r["relay_counted"]
        assert probe["delivered"] > 0 or name in others or cut, (name, probe)
        if r["limit"] == "raised":
            assert probe["complete"] and probe["mb_per_s"] > 0, (name, probe)
            assert DEFAULT_DATA_LIMIT not in r["relay_counted"], (name, r)
        elif r["limit"] == "128KiB":  # what was in flight past the relay's budget is lost with the reset
            assert not probe["complete"] and probe["delivered"] <= DEFAULT_DATA_LIMIT, (name, probe)
            assert DEFAULT_DATA_LIMIT in r["relay_counted"], (name, r)
            assert probe["sender_error"] and (probe["receiver_error"] or probe["receiver_pending"]), (name, probe)
    counts = s["limits_by_variant"]
    assert all(sum(c.values()) == PER_VARIANT for c in counts.values()), counts

    # relayed bulk only exists if some relay came up with the raised limits (a start-up race)
    relayed = s["relayed"]
    if any(r["limit"] == "raised" for r in relays.values()):
        assert relayed["relay"] in relays and relayed["transfers"], relayed
        assert all(t["complete"] and t["relayed"] for t in relayed["transfers"]), relayed
        assert 0 < relayed["best_mb_per_s"] <= RATE_MBIT / 8 * 1.3, relayed
    else:
        assert relayed["relay"] is None and relayed["transfers"] == [] and relayed["best_mb_per_s"] is None

    # direct public -> public over libp2p completes at about the link rate, like raw TCP
    direct = s["direct"]
    assert [t["nbytes"] for t in direct["transfers"]] == [1_000_000]
    for t in direct["transfers"]:
        assert t["complete"] and t["delivered"] == t["nbytes"] and not t["relayed"], t
        assert 0 < t["mb_per_s"] <= RATE_MBIT / 8 * 1.3, t
    assert 0 < direct["raw_tcp"]["mb_per_s"] <= RATE_MBIT / 8 * 1.5, direct["raw_tcp"]
    assert "relay      extra p2pd flags" in proc.stdout and "direct" in proc.stdout
