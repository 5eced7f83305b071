"""Joining through initial peers that are dead, silent, wrong, of another run, late or dying: real
`p2pdiloco join` processes on 127.0.0.1. A join that cannot work is one line on stderr and exit
code 2, naming the address and why; one that can (a live peer among dead ones, a peer that starts
later, a peer that dies once we are in) goes on.

One live peer `a` (run "tiny") serves the cases that need one; the late-peer and dying-peer cases
run their own small swarms.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import hivemind
import pytest
from hivemind.p2p import P2P, PeerID

from p2pdiloco import bootstrap
from p2pdiloco import swarm as swarm_module
from p2pdiloco.config import Config, ConfigError
from p2pdiloco.localswarm import LocalSwarm, kill_group
from tests.conftest import LOOPBACK_DHT, TINY

pytestmark = pytest.mark.timeout(150)

SOME_ID = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"  # well-formed; nobody here has it
BOOT = 6.0  # --bootstrap-timeout of the joiners that must fail
JOINER = ["--inner-steps", "30", "--state-timeout", "10"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(*args: str, timeout: float = 90):
    """Run `p2pdiloco join` to its end; (exit code, stderr, seconds). Its process group dies after."""
    cmd = [sys.executable, "-m", "p2pdiloco", "join", "--config", TINY, *args]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return proc.returncode, out + err, time.monotonic() - t0


def one_line_error(code: int, stderr: str, *fragments: str, after_start: bool = False) -> str:
    """Exit code 2 and one error line; after_start: the peer's startup lines may come before it."""
    assert code == 2, (code, stderr)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr and lines[-1].startswith("p2pdiloco: error: "), stderr
    assert after_start or len(lines) == 1, stderr
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]
    return lines[-1]


def stop(swarm: LocalSwarm, name: str) -> None:
    """SIGTERM one peer and wait for it; whatever is left of its group is killed."""
    swarm.signal(name, signal.SIGTERM, whole_group=False)
    try:
        swarm.wait_exit(name, timeout=20)
    except subprocess.TimeoutExpired:
        swarm.reap(swarm.peers[name])


# ------------------------------------------------------------------------------ failures


def test_refused_fails_after_retrying(corpus):
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{SOME_ID}"
    code, err, took = join("--data", str(corpus), "--initial-peers", dead, "--bootstrap-timeout", str(BOOT))
    line = one_line_error(code, err, f"could not join through {dead}", "connection refused", "retried for")
    assert took < BOOT + 20, (took, line)


def test_silent_listener_is_a_handshake_timeout(corpus):
    """Something accepts TCP there but never speaks libp2p."""
    server = socket.create_server(("127.0.0.1", 0))
    held, done = [], threading.Event()

    def accept():
        while not done.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    addr = f"/ip4/127.0.0.1/tcp/{server.getsockname()[1]}/p2p/{SOME_ID}"
    try:
        code, err, took = join("--data", str(corpus), "--initial-peers", addr, "--bootstrap-timeout", str(BOOT))
    finally:
        done.set()
        server.close()
        for conn in held:
            conn.close()
        thread.join(timeout=5)
    line = one_line_error(code, err, addr, "handshake timed out")
    assert held, "the joiner never connected"
    assert took < BOOT + 35, (took, line)


def test_stop_event_ends_the_retries():
    """SIGTERM while the initial peers are still down: the peer stops within seconds."""
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{SOME_ID}"
    cfg = Config(initial_peers=[dead], host_maddrs=["/ip4/127.0.0.1/tcp/0"], bootstrap_timeout=60)
    stop_event = threading.Event()
    timer = threading.Timer(1.0, stop_event.set)
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            bootstrap.start_dht(cfg, stop_event=stop_event)
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 10


def test_malformed_initial_peers_file(tmp_path, corpus):
    path = tmp_path / "peers.txt"
    path.write_text(f"# the swarm\n/ip4/127.0.0.1/tcp/1/p2p/{SOME_ID}\nnot-a-multiaddr\n")
    code, err, _ = join("--data", str(corpus), "--initial-peers-file", str(path), timeout=60)
    one_line_error(code, err, f"initial_peers_file {path} line 3", "not-a-multiaddr")


@pytest.mark.parametrize("content, fragments", [
    (None, ["initial_peers_file not found"]),
    ("# nobody yet\n\n", ["no multiaddrs in initial_peers_file"]),
    ("/ip4/127.0.0.1/tcp/1\n", ["line 1", "no /p2p/<peer id>"]),
])
def test_bad_initial_peers_file(tmp_path, content, fragments):
    path = tmp_path / "peers.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as e:
        Config.from_sources(TINY, {"initial_peers_file": str(path)})
    assert str(path) in str(e.value) and all(f in str(e.value) for f in fragments), e.value


def test_initial_peers_file_adds_to_initial_peers(tmp_path):
    a, b = (f"/ip4/127.0.0.1/tcp/{port}/p2p/{SOME_ID}" for port in (1, 2))
    path = tmp_path / "peers.txt"
    path.write_text(f"{a}\n\n  # b too\n{b}  # the second\n")
    cfg = Config.from_sources(TINY, {"initial_peers": [a], "initial_peers_file": str(path)})
    assert cfg.initial_peers == [a, b]


# ------------------------------------------------------------------------------ joins


def test_joiner_started_before_its_initial_peer(tmp_path, corpus):
    """The retry: j starts first and keeps knocking; x comes up later (fixed port and identity)
    at the address j was given."""
    identity = tmp_path / "x.key"
    P2P.generate_identity(str(identity))
    x_id = PeerID.from_identity(identity.read_bytes()).to_base58()
    port = free_port()
    x_addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{x_id}"
    with LocalSwarm(tmp_path, config=TINY, extra_args=["--data", str(corpus), *JOINER]) as s:
        s.start("j", "--initial-peers", x_addr, "--bootstrap-timeout", "60", "--log-level", "info")
        s.wait_for(lambda: "connection refused); retrying" in s.stderr("j", tail=100_000), timeout=60,
                   what="j retrying")
        s.start("x", "--identity-path", str(identity), "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}")
        s.wait_for(lambda: s.events("j", "join"), timeout=90, what="j loaded x's state")
        assert s.peers["j"].proc.poll() is None and s.peers["x"].proc.poll() is None


def test_initial_peer_dies_during_startup(tmp_path, corpus):
    """c joins through a only; a dies (SIGKILL, its p2pd too) as soon as c's DHT is up: c goes on
    through b, the peer it learned from a (state from b, rounds with b)."""
    with LocalSwarm(tmp_path, config=TINY, extra_args=["--data", str(corpus), *JOINER]) as s:
        s.start("a")
        s.start("b", join="a")
        s.wait_for(lambda: s.events("b", "join") and s.events("a", "outer"), timeout=90, what="a and b averaging")
        b_addr = s.maddr("b")
        s.start("c", join="a")
        deadline = time.monotonic() + 60
        while "up at" not in s.stderr("c", tail=100_000):
            assert time.monotonic() < deadline and s.peers["c"].proc.poll() is None, s.stderr("c")
            time.sleep(0.02)
        s.signal("a", signal.SIGKILL)
        s.wait_for(lambda: s.peers["c"].proc.poll() is not None or any(r["group_size"] >= 2 for r in
                                                                        s.events("c", "outer")),
                   timeout=90, what="an outer step of c with b")
        assert s.peers["c"].proc.poll() is None, s.stderr("c")
        assert s.events("c", "join"), "c loaded the state from b"
        # a dead state source is an expected event: at most one warning line, never a traceback
        assert "Traceback" not in s.stderr("c", tail=1 << 30), s.stderr("c")

        # what a DHT that restarts (e.g. as a client) would bootstrap through, now that a is gone
        cfg = Config.from_sources(TINY, {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"]})
        dht = hivemind.DHT(start=True, initial_peers=[b_addr], **LOOPBACK_DHT)
        try:
            assert b_addr in swarm_module.learned_peers(dht, cfg, timeout=10)
        finally:
            dht.shutdown()


# ------------------------------------------------------------------------------ through a live peer


@pytest.fixture(scope="module")
def live(tmp_path_factory, corpus):
    """A swarm of one training peer `a` of run "tiny"; the tests add joiners to it."""
    workdir = tmp_path_factory.mktemp("bootstrap")
    with LocalSwarm(workdir, config=TINY, extra_args=["--data", str(corpus), *JOINER]) as s:
        s.start("a")
        s.wait_for(lambda: s.events("a", "inner"), timeout=60, what="a training")
        yield s


def test_wrong_peer_id(live, corpus):
    """a's address with somebody else's id: the handshake finds a, not the peer we asked for."""
    wrong = live.maddr("a").rsplit("/p2p/", 1)[0] + f"/p2p/{SOME_ID}"
    code, err, took = join("--data", str(corpus), "--initial-peers", wrong, "--bootstrap-timeout", "30")
    line = one_line_error(code, err, wrong, "peer id does not match", live.maddr("a").rsplit("/", 1)[1])
    assert "retried" not in line, line  # another peer answers there: no point retrying


def test_initial_peer_of_another_run(live, corpus):
    a = live.maddr("a")
    code, err, _ = join("--data", str(corpus), "--run-id", "other", "--initial-peers", a)
    one_line_error(code, err, f"initial peer {a} is training run 'tiny', not 'other': use --run-id tiny (or that "
                              "run's preset), or join through a peer of run 'other'", after_start=True)


def test_first_initial_peer_dead_second_alive(live):
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{SOME_ID}"
    try:
        live.start("b", "--initial-peers", dead, live.maddr("a"), "--bootstrap-timeout", "30")
        live.wait_for(lambda: live.events("b", "join"), timeout=60, what="b loaded a's state")
        assert live.peers["b"].proc.poll() is None, live.stderr("b")
    finally:
        stop(live, "b")


def test_initial_peers_file_joins(live, tmp_path):
    path = tmp_path / "peers.txt"
    path.write_text(f"# run tiny\n\n{live.maddr('a')}   # a\n")
    try:
        live.start("c", "--initial-peers-file", str(path))
        live.wait_for(lambda: live.events("c", "join"), timeout=60, what="c loaded a's state")
    finally:
        stop(live, "c")


def test_stale_daemon_sockets_are_swept(tmp_path):
    """A SIGKILLed peer leaves its p2pd and client sockets behind: the next start removes those that
    nobody listens on (and are not brand new), and keeps live ones."""
    import os
    import socket

    from p2pdiloco.bootstrap import sweep_stale_sockets

    dead, live, young = (tmp_path / f"hivemind-p2pd-{n}.sock" for n in ("dead", "live", "young"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        for path in (dead, young):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(str(path))
            s.close()  # the file stays, nobody listens: what a killed daemon leaves
        listener.bind(str(live))
        listener.listen(1)
        for path in (dead, live):
            os.utime(path, (0, 0))  # old
        assert sweep_stale_sockets(str(tmp_path)) == 1
        assert not dead.exists() and live.exists() and young.exists()
    finally:
        listener.close()


async def _dht_settings(_dht, node) -> tuple:  # runs in the DHT's process: a module-level function pickles
    return node.protocol.bucket_size, node.num_replicas, node.cache_locally, node.cache_nearest


def test_a_small_beam_still_reads_every_record():
    """start_dht keeps a Kademlia beam of DHT_BUCKET_SIZE nodes holding DHT_REPLICAS copies (hivemind's 20 and 5:
    below 21 peers every lookup asked all the others) and no node cache. With twice as many nodes as the beam,
    every node still reads every node's entry of one key, the way the schedule reads the progress records."""
    from hivemind.utils import get_dht_time

    n = 2 * bootstrap.DHT_BUCKET_SIZE
    loopback = ["/ip4/127.0.0.1/tcp/0"]
    dhts = []
    try:
        dhts.append(bootstrap.start_dht(Config(host_maddrs=loopback)))
        addrs = [str(a) for a in dhts[0].get_visible_maddrs()]
        for _ in range(n - 1):
            dhts.append(bootstrap.start_dht(Config(initial_peers=addrs, host_maddrs=loopback)))
        settings = dhts[-1].run_coroutine(_dht_settings)
        assert settings == (bootstrap.DHT_BUCKET_SIZE, bootstrap.DHT_REPLICAS, False, 0)
        for i, dht in enumerate(dhts):
            assert dht.store("progress", subkey=f"peer{i}", value=i, expiration_time=get_dht_time() + 120)
        for dht in dhts:
            found = dht.get("progress", latest=True)
            assert found is not None and {k: v.value for k, v in found.value.items()} == \
                {f"peer{i}": i for i in range(n)}
    finally:
        for dht in dhts:
            dht.shutdown()


async def _forget_everyone(_dht, node) -> None:  # runs in the DHT's process
    for node_id in list(node.protocol.routing_table.uid_to_peer_id):
        del node.protocol.routing_table[node_id]


def test_a_dht_split_by_a_freeze_is_pinged_back_together():
    """hivemind drops a peer that did not answer from its routing table, on both sides, and then never
    asks it again: after a freeze (a SIGSTOPped joiner in the suite) the sleeper's DHT and the others'
    were split for good. A read of the progress records that shows nobody else pings the peers we
    knew (here the initial peer) back in."""
    from hivemind.utils import get_dht_time

    from p2pdiloco.records import SwarmRecords

    loopback = ["/ip4/127.0.0.1/tcp/0"]
    dhts, records = [], None
    try:
        dhts.append(bootstrap.start_dht(Config(host_maddrs=loopback)))
        addrs = [str(a) for a in dhts[0].get_visible_maddrs()]
        cfg = Config(initial_peers=addrs, host_maddrs=loopback)
        dhts.append(bootstrap.start_dht(cfg))
        a, b = dhts
        for dht in dhts:  # what both sides did to each other during the freeze
            dht.run_coroutine(_forget_everyone)
        assert a.store("probe", subkey="a", value=1, expiration_time=get_dht_time() + 60)
        assert b.get("probe", latest=True) is None  # split: b's lookups ask nobody
        records = SwarmRecords(b, cfg, swarm_size=lambda: 2)
        records._keep_in_touch({str(b.peer_id): {}})  # a read that shows only ourselves
        found = b.get("probe", latest=True)
        assert found is not None and found.value["a"].value == 1
        records._keep_in_touch({str(b.peer_id): {}, str(a.peer_id): {}})
        assert not records._cut_off
    finally:
        if records is not None:
            records.close()
        for dht in dhts:
            dht.shutdown()
