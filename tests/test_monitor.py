"""`p2pdiloco status` and `p2pdiloco monitor` end to end: real CLI processes against one real
2-peer swarm on 127.0.0.1, the dashboard rendered by headless Chromium (Debian's `chromium`,
installed by scripts/setup.sh), and a killed peer dropping out once its record expires (15 s).
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from types import SimpleNamespace

import pytest

from p2pdiloco.localswarm import LocalSwarm, kill_group
from tests.conftest import TINY, group_left

pytestmark = pytest.mark.timeout(240)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-default-apps", "--no-first-run",
                  "--disable-domain-reliability"]
SOME_PEER_ID = "12D3KooWFToYgpnDWgeajKtXorr3ubh27ZaW9nzuv6PbxL8KNFMu"  # well-formed; nobody has it here


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, corpus):
    workdir = tmp_path_factory.mktemp("monitor_swarm")
    with LocalSwarm(workdir, config=TINY, extra_args=["--data", str(corpus), "--inner-steps", "30"]) as s:
        s.start("a")
        s.start("b", join="a")
        yield s


def peer_id(swarm, name: str) -> str:
    return swarm.maddr(name).split("/p2p/")[-1]


# ----------------------------------------------------------------------------- helpers


def spawn(*args: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    """`p2pdiloco ARGS` in its own process group (its DHT process and p2pd included)."""
    return subprocess.Popen([sys.executable, "-m", "p2pdiloco", *args], stdout=stdout, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)


stop_group = kill_group  # nothing is left of a command's process group after a clean exit


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    proc = spawn(*args)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        stop_group(proc)


def status_json(maddr: str) -> list[dict]:
    result = cli("status", "--initial-peers", maddr, "--run-id", "tiny", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"{what} not reached within {timeout}s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Elements(HTMLParser):
    """Every element of a page with its attributes and the ids of its ancestors."""

    def __init__(self):
        super().__init__()
        self.stack, self.found = [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.found.append((tag, attrs, [a.get("id") for _, a in self.stack]))
        if tag not in ("meta", "br", "input", "link", "img"):
            self.stack.append((tag, attrs))

    def handle_startendtag(self, tag, attrs):
        self.found.append((tag, dict(attrs), [a.get("id") for _, a in self.stack]))

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop()[0] == tag:
                break


class FakeDHT:
    """DHT.get(key, latest=True, return_future=True) over a dict key -> {subkey: value}."""

    def __init__(self, data: dict):
        self.data = data

    def get(self, key, latest, return_future):
        subkeys = self.data.get(key)
        found = None if subkeys is None else SimpleNamespace(
            value={k: SimpleNamespace(value=v) for k, v in subkeys.items()})
        return SimpleNamespace(result=lambda timeout: found)


# ------------------------------------------------------------------------------- tests


def test_records_checked_and_history_bounded():
    from hivemind.utils import get_dht_time

    from p2pdiloco.monitor import SwarmWatch
    from p2pdiloco.status import data_line, format_table, read_data_coverage, read_swarm
    from p2pdiloco.swarm import PROGRESS_FIELDS

    now = time.time()
    good = {"outer_step": 3, "inner_step": 90, "loss": float("nan"), "tokens_per_s": 1000.0, "device": "cpu",
            "maddrs": ["/ip4/127.0.0.1/tcp/5/p2p/P1"], "reachability": "direct", "time": now - 2,
            "data": {"epoch": 1, "shard": 4, "cursor": 17, "shards": 5}}
    claims = {"0": {"done": True}, "4": {"lease_until": get_dht_time() + 60, "cursor": 17},
              "2": {"lease_until": get_dht_time() - 1, "cursor": 9}}  # a lease run out: free again
    # P1's progress record holds the schedule's fields, its status record the rest (swarm.PROGRESS_FIELDS);
    # P5 left: its status record outlives its progress record, and it is not listed
    status = {"P1": {**good, "time": now - 9, "outer_step": 2}, "P5": {**good, "time": now - 9}}
    data = {"p2pdiloco_tiny_configs": {"P1": "fp1", "P2": "fp1", "P3": "fp2", "P5": "fp1"},
            "p2pdiloco_tiny_fp1_progress": {"P1": {k: good[k] for k in PROGRESS_FIELDS if k in good},
                                            "P2": {"outer_step": "7", "time": now, "maddrs": "x"},
                                            "P4": {**good, "left": True}},  # stopped cleanly: not listed
            "p2pdiloco_tiny_fp1_status": status,
            "p2pdiloco_tiny_fp2_progress": {"P3": {"outer_step": 9}},  # no time: dropped
            "p2pdiloco_tiny_fp1_data_e1": claims}
    records = read_swarm(FakeDHT(data), "tiny", "")
    assert [r["peer"] for r in records] == ["P1", "P2"]
    assert records[0]["time"] == now - 2 and records[0]["outer_step"] == 3  # the fresher progress record wins
    assert records[1]["outer_step"] is None and records[1]["maddrs"] == []  # wrong types are not trusted
    table = format_table(records, "tiny", now=now).splitlines()
    assert table[1].split()[:8] == ["P1", "/ip4/127.0.0.1/tcp/5", "direct", "cpu", "3", "90", "-", "1,000"]
    assert table[2].split()[2] == "?"  # a peer that did not say how it is reached
    assert table[-1] == "2 peer(s), swarm 1,000 tokens/s, highest outer step 3"
    assert table[1].split()[8] == "e1/s4@17" and table[2].split()[8] == "-"  # epoch/shard@cursor read
    cov = read_data_coverage(FakeDHT(data), records, "tiny", "")
    assert cov == {"epoch": 1, "shards": 5, "done": 1, "claimed": 1, "free": 3}
    assert data_line(cov) == "data: epoch 1, 5 shards: 1 done, 1 claimed, 3 free"

    watch = SwarmWatch(FakeDHT(data), "tiny", "", interval=1, timeout=1, max_points=3, max_peers=2)
    progress = data["p2pdiloco_tiny_fp1_progress"]["P1"]
    for step in range(5):
        watch.poll()  # the same records again: no new points
        progress.update(time=now + step, outer_step=4 + step)
        watch.poll()
    snap = json.loads(json.dumps(watch.snapshot(), allow_nan=False))
    history = {h["peer"]: h["points"] for h in snap["history"]}
    assert [p["outer_step"] for p in history["P1"]] == [6, 7, 8] and len(history["P2"]) == 1
    assert snap["peers"][0]["loss"] is None and len(snap["swarm"]) == 3
    data["p2pdiloco_tiny_configs"]["P4"] = "fp3"
    data["p2pdiloco_tiny_fp3_progress"] = {"P4": {"time": now + 10}}
    watch.poll()  # a third peer: P2, heard from longest ago, is forgotten
    assert [h["peer"] for h in watch.snapshot()["history"]] == ["P1", "P4"]


def test_bad_input_exits_2_with_one_line():
    unreachable = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{SOME_PEER_ID}"
    procs = [spawn("status", "--initial-peers", unreachable, "--run-id", "tiny", "--timeout", "3"),
             spawn("status", "--initial-peers", "/ip4/300.1.2.3/tcp/1"),
             spawn("monitor", "--initial-peers", unreachable, "--port", "70000")]
    try:
        results = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            stop_group(p)
    for proc, (out, err), what in zip(procs, results, ["unreachable", "malformed", "port"]):
        assert proc.returncode == 2, (what, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("p2pdiloco: error: "), (what, err)
        assert out == ""
    assert "could not join" in results[0][1]
    assert "300.1.2.3" in results[1][1]
    assert "70000" in results[2][1]


def test_status_lists_both_peers(swarm):
    ids = {peer_id(swarm, "a"), peer_id(swarm, "b")}
    # both have published a record (at the same time as their first `inner` metric): one status call will do
    swarm.wait_for(lambda: swarm.events("a", "inner") and swarm.events("b", "inner"), timeout=90,
                   what="a first record from both peers")
    records = wait_until(lambda: (r := status_json(swarm.maddr("a"))) and {x["peer"] for x in r} == ids and r,
                         timeout=90, what="both peers in status --json")
    for r in records:
        assert r["device"] == "cpu"
        assert r["inner_step"] > 0 and r["outer_step"] >= 0 and r["tokens"] > 0
        assert r["tokens_per_s"] > 0
        assert r["loss"] is None or 0 < r["loss"] < 6
        assert abs(time.time() - r["time"]) < 30
        assert any(m.split("/p2p/")[-1] == r["peer"] for m in r["maddrs"]), r["maddrs"]
        assert r["maddrs"][0].startswith("/ip4/127.0.0.1/")
    text = cli("status", "--initial-peers", swarm.maddr("b"), "--config", TINY)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.strip().splitlines()
    assert lines[0].split()[:4] == ["PEER", "ADDRESS", "REACH", "DEVICE"], text.stdout
    assert {line.split()[0] for line in lines[1:-1]} == ids, text.stdout
    assert lines[-1].startswith("2 peer(s), swarm "), text.stdout
    assert all(" cpu " in line for line in lines[1:-1]), text.stdout
    assert all(line.split()[2] == "local" for line in lines[1:-1]), text.stdout  # loopback peers: nothing to check


def test_monitor_page_in_chromium(swarm, tmp_path):
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"chromium ({CHROMIUM}) is missing: run scripts/setup.sh, which installs Debian's chromium")
    ids = {peer_id(swarm, "a"), peer_id(swarm, "b")}
    monitor = spawn("monitor", "--initial-peers", swarm.maddr("a"), "--run-id", "tiny", "--port", "0",
                    "--interval", "1")
    browser = None
    try:
        ready, _, _ = select.select([monitor.stdout], [], [], 60)
        assert ready, "monitor printed no URL within 60s"
        line = monitor.stdout.readline()
        assert line.startswith("p2pdiloco monitor: http://127.0.0.1:"), (line, monitor.stderr.read())
        url = line.split()[2]

        def api() -> dict:
            with urllib.request.urlopen(url + "api/swarm", timeout=10) as r:
                assert r.headers["Content-Type"] == "application/json"
                return json.loads(r.read())

        def two_points_each():
            data = api()
            history = {h["peer"]: h["points"] for h in data["history"]}
            return data if {p["peer"] for p in data["peers"]} == ids and all(
                len(history.get(p, [])) >= 2 for p in ids) else None

        data = wait_until(two_points_each, timeout=60, what="2 history points per peer in /api/swarm")
        assert data["summary"]["peers"] == 2 and data["summary"]["tokens_per_s"] > 0
        assert data["swarm"] and data["error"] is None
        with urllib.request.urlopen(url, timeout=10) as r:
            page = r.read().decode()
        assert "<script src" not in page and "<link" not in page and "https://" not in page  # self-contained
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(url + "nope", timeout=10)

        browser = subprocess.Popen([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}",
                                    "--virtual-time-budget=5000", "--dump-dom", url],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                   start_new_session=True)
        dom, _ = browser.communicate(timeout=60)
        elements = Elements()
        elements.feed(dom)
        rows = {a["data-peer"] for tag, a, parents in elements.found if tag == "tr" and "peers" in parents
                and "data-peer" in a}
        assert rows == ids, dom[:3000]
        curves = {a["data-peer"]: a["points"].split() for tag, a, parents in elements.found
                  if tag == "polyline" and "loss-chart" in parents and a.get("data-series") == "loss"}
        assert set(curves) == ids, dom[:3000]
        for points in curves.values():
            assert len(points) >= 2
            assert all(math.isfinite(float(v)) for p in points for v in p.split(","))
        for chart in ("outer-chart", "group-chart", "tps-chart"):
            assert any(tag == "polyline" and chart in parents for tag, _, parents in elements.found), chart

        monitor.send_signal(signal.SIGTERM)
        assert monitor.wait(timeout=20) == 0, monitor.stderr.read()
        assert group_left(monitor.pid) == [], "the monitor's DHT process or p2pd outlived it"
    finally:
        if browser is not None:
            stop_group(browser)
        stop_group(monitor)


def test_killed_peer_drops_out(swarm):
    a, b = peer_id(swarm, "a"), peer_id(swarm, "b")
    swarm.signal("b", signal.SIGKILL)
    swarm.wait_exit("b", timeout=10)  # and reaps its process group, p2pd included
    records = wait_until(lambda: (r := status_json(swarm.maddr("a"))) and [x["peer"] for x in r] == [a] and r,
                         timeout=60, what="b gone from status (its record expires after 15 s)")
    assert records[0]["peer"] == a and b not in json.dumps(records)
