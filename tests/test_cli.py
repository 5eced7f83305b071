"""The CLI's promises: one-line errors with exit code 2, and a stock hivemind DHT as initial peer."""

from __future__ import annotations

import subprocess
import sys
import time

import hivemind
import pytest

from p2pdiloco.localswarm import LocalSwarm
from tests.conftest import LOOPBACK_DHT, TINY

pytestmark = pytest.mark.timeout(180)

# a well-formed address where nobody listens
DEAD_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def run_cli(*args, timeout=60):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "p2pdiloco", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    return proc, time.monotonic() - t0


def assert_usage_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("args, fragments", [
    (["join", "--no-such-flag"], ["unrecognized arguments", "--no-such-flag"]),
    (["join", "--inner-steps", "abc"], ["--inner-steps", "invalid int value"]),
    (["join", "--inner-steps", "0"], ["inner_steps must be >= 1"]),
    (["join", "--outer-lr", "-1"], ["outer_lr must be a positive number"]),
    (["join", "--config", "/nonexistent/preset.toml"], ["config file not found"]),
    (["join", "--initial-peers", "not-a-multiaddr"], ["malformed initial_peers", "not-a-multiaddr"]),
    (["frobnicate"], ["invalid choice", "frobnicate"]),
    (["join", "--device", "cuda:99"], ["cuda:99", "--device cpu"]),  # no machine of ours has 100 GPUs
])
def test_bad_input_is_one_line_exit_2(args, fragments):
    proc, _ = run_cli(*args)
    assert_usage_error(proc, *fragments)


def test_unknown_config_key(tmp_path):
    preset = tmp_path / "bad.toml"
    preset.write_text('[model]\nn_layer = 2\nn_layyer = 3\n')
    proc, _ = run_cli("join", "--config", str(preset))
    assert_usage_error(proc, "unknown config key", "n_layyer")


def test_unreadable_data_path(tmp_path):
    proc, _ = run_cli("join", "--config", TINY, "--data", str(tmp_path / "missing.txt"))
    assert_usage_error(proc, "data path does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    proc, _ = run_cli("join", "--config", TINY, "--data", str(empty))
    assert_usage_error(proc, "no .txt files")


def test_unreachable_initial_peer_fails_within_timeout(corpus):
    proc, took = run_cli("join", "--config", TINY, "--data", str(corpus), "--initial-peers", DEAD_PEER,
                         "--bootstrap-timeout", "5")
    assert_usage_error(proc, "could not join through")
    assert took < 40, took


def test_help_lists_every_config_key():
    proc, _ = run_cli("join", "--help")
    assert proc.returncode == 0
    for flag in ("--inner-steps", "--outer-lr", "--outer-momentum", "--host-maddrs", "--announce-maddrs",
                 "--identity-path", "--maddrs-file", "--run-id", "--client-mode", "--use-relay",
                 "--use-auto-relay", "--max-time", "--log-dir"):
        assert flag in proc.stdout, flag


def test_stock_hivemind_dht_as_initial_peer(tmp_path, corpus):
    """Two peers that only know a plain hivemind DHT node find each other and average."""
    dht = hivemind.DHT(start=True, **LOOPBACK_DHT)
    try:
        stock = [str(a) for a in dht.get_visible_maddrs()][0]
        args = ["--data", str(corpus), "--inner-steps", "30", "--state-timeout", "3", "--initial-peers", stock]
        with LocalSwarm(tmp_path, config=TINY, extra_args=args) as swarm:
            swarm.start("a")
            swarm.wait_for(lambda: swarm.events("a", "inner"), timeout=60, what="a training")
            swarm.start("b")
            swarm.wait_for(lambda: all(swarm.events(n, "outer") for n in "ab"), timeout=120,
                           what="an outer step on both peers")
            assert not swarm.events("a", "join"), "nobody shared state when a joined: it starts the swarm"
            assert swarm.events("b", "join"), "b found a's state through the stock DHT"
            codes = swarm.stop_all()
        assert codes == {"a": 0, "b": 0}
    finally:
        dht.shutdown()


def test_other_run_id_never_averages(tmp_path, corpus):
    """Two runs that share a DHT (through a stock node: joining through a peer of another run is
    refused, tests/test_bootstrap.py) never average together."""
    args = ["--data", str(corpus), "--inner-steps", "30", "--state-timeout", "3"]
    with LocalSwarm(tmp_path, config=TINY, extra_args=args) as swarm:
        swarm.start_bootstrap("boot")
        swarm.start("a", "--run-id", "red", join="boot")
        swarm.start("b", "--run-id", "blue", join="boot")
        swarm.start("c", "--run-id", "red", join="boot")
        swarm.wait_for(lambda: len(swarm.events("a", "outer")) >= 2, timeout=120, what="red averages")
        swarm.wait_for(lambda: len(swarm.events("b", "round_failed")) >= 2, timeout=60, what="blue alone")
        assert not swarm.events("b", "outer"), "a peer of another run joined a group"
        assert all(r["group_size"] == 2 for r in swarm.events("a", "outer"))


def test_other_model_config_is_refused(tmp_path, corpus):
    args = ["--data", str(corpus), "--state-timeout", "3"]
    with LocalSwarm(tmp_path, config=TINY, extra_args=args) as swarm:
        swarm.start("a")
        swarm.wait_for(lambda: swarm.events("a", "inner"), timeout=60, what="a training")
        swarm.start("b", "--n-embd", "32", join="a")
        code = swarm.wait_exit("b", timeout=60)
        assert code == 2
        assert "another model config or wire format" in swarm.stderr("b")
