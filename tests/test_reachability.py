"""reachability.py's pure parts: which addresses a helper dials back, its TCP probe, the verdict
from the helpers' answers and the paragraph a volunteer reads; and the one warning line a joiner
gets for a state source it cannot dial. The check between real peers
behind real NAT routers is in tests/test_internet.py."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

from p2pdiloco import reachability
from p2pdiloco.config import Config

PEER = "12D3KooWBhfPT67whLc2mspE1KeGMCVUUtWTvDtVGFfh4F31Zo1C"


def test_dialable_targets_skip_loopback_relays_and_duplicates():
    maddrs = [f"/ip4/127.0.0.1/tcp/5000/p2p/{PEER}", f"/ip4/10.214.2.2/tcp/5000/p2p/{PEER}",
              f"/ip4/10.214.2.2/tcp/5000/p2p/{PEER}", "/ip4/0.0.0.0/tcp/5000",
              f"/ip4/203.0.113.7/tcp/4001/p2p/{PEER}/p2p-circuit/p2p/{PEER}", "/ip6/::1/tcp/1",
              "/ip4/203.0.113.9/udp/4001/quic", "/dns4/example.org/tcp/1", "not a maddr"]
    assert reachability.dialable_targets(maddrs) == [("/ip4/10.214.2.2/tcp/5000", "10.214.2.2", 5000)]


def test_tcp_probe_says_why(tmp_path):
    async def probes():
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            open_port = listener.getsockname()[1]
            with socket.socket() as unused:
                unused.bind(("127.0.0.1", 0))
                closed_port = unused.getsockname()[1]  # bound, never listening: refused
                return (await reachability._tcp_probe("127.0.0.1", open_port),
                        await reachability._tcp_probe("127.0.0.1", closed_port))

    ok, refused = asyncio.run(probes())
    assert ok == "" and refused == "connection refused"


def _check(answers: list, maddrs: list) -> reachability.Reachability:
    """reachability.check with the DHT's coroutine runner answering as the helpers would."""
    dht = SimpleNamespace(run_coroutine=lambda fn: answers)
    return reachability.check(dht, Config(), maddrs, helpers=["h1", "h2", "h3"])


def test_verdict_from_the_helpers_answers():
    mine = [f"/ip4/10.214.2.2/tcp/5000/p2p/{PEER}"]
    target = "/ip4/10.214.2.2/tcp/5000"
    reached = {"reached": [target], "errors": {}}
    failed = {"reached": [], "errors": {target: "timed out after 3s"}}
    assert _check([reached, None, failed], mine).mode == "direct"      # half of those that answered
    refused = _check([failed, failed, None], mine)
    assert refused.mode == "client" and refused.answers == 2 and refused.errors == {target: "timed out after 3s"}
    assert _check([None, None, None], mine).mode == "unknown"          # nobody answered: first peer
    assert _check([reached], [f"/ip4/127.0.0.1/tcp/5000/p2p/{PEER}"]).mode == "local"
    # a helper that claims an address we never asked about does not count
    assert _check([{"reached": ["/ip4/203.0.113.1/tcp/1"]}], mine).mode == "client"


def test_the_paragraph_names_a_port_to_forward():
    cfg = Config(host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    text = reachability.Reachability(mode="client", tried=["/ip4/10.214.2.2/tcp/41485"], answers=2,
                                     errors={"/ip4/10.214.2.2/tcp/41485": "timed out after 3s"}).explain(cfg)
    assert text.startswith("p2pdiloco: NOT reachable: 2 peer(s)") and "timed out after 3s" in text
    # tcp/0 changes at every start: advise a fixed port instead of the one we happened to get
    assert "forward TCP port 31337" in text and "--announce-maddrs /ip4/<your public ip>/tcp/31337" in text
    fixed = Config(host_maddrs=["/ip4/0.0.0.0/tcp/4001"])
    assert "forward TCP port 4001" in reachability.Reachability(mode="client").explain(fixed)
    assert "client mode" in reachability.Reachability(mode="client").explain(cfg, forced=True)
    direct = reachability.Reachability(mode="direct", reached=["/ip4/203.0.113.9/tcp/31337"], answers=3)
    assert "reachable: 3 peer(s) dialed us back at /ip4/203.0.113.9/tcp/31337" in direct.explain(cfg)


def test_a_failed_state_source_is_one_warning_line():
    """hivemind logs a source it cannot dial as ERROR with a traceback (seen at 10 Mbit/s: 'dial
    backoff'); the joiner goes on to the next source, so the user gets one warning line."""
    import io
    import logging

    from p2pdiloco.averaging import quiet_expected_events

    quiet_expected_events()
    log = logging.getLogger("hivemind.averaging.averager")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
    log.addHandler(handler)
    try:
        try:
            raise ConnectionError("failed to dial:\n  * [/ip4/10.213.0.3/tcp/1] dial backoff")
        except ConnectionError as e:
            log.exception(f"Failed to download state from 12D3KooWPeer - {e!r}")
        log.error("some other error")
    finally:
        log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[WARNING] Failed to download state from 12D3KooWPeer - ConnectionError(")
    assert "dial backoff" in lines[0] and "Traceback" not in out.getvalue()
    assert lines[1:] == ["[ERROR] some other error"]
