"""--run-secret: strangers cannot join, read the run's records, take part in rounds or download state."""

from __future__ import annotations

import asyncio
import time

import hivemind
import pytest
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.averaging import DilocoAverager
from p2pdiloco.config import Config
from p2pdiloco.localswarm import LocalSwarm
from tests.conftest import LOOPBACK_DHT, TINY

pytestmark = pytest.mark.timeout(240)

SECRET = "correct horse battery staple"


async def _call_rpcs(dht, peer_id: str, prefix: str):
    """A stranger's direct calls: download the state, then ask to join a group with no token."""
    p2p = await dht.replicate_p2p()
    stub = DilocoAverager.get_stub(p2p, PeerID.from_base58(peer_id), namespace=prefix)
    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
    downloaded = [message async for message in stream]
    ask = DilocoAverager.serializer.dumps({"start": 0, "stop": 1000, "state_id": None})
    stream = await stub.rpc_state_chunk(averaging_pb2.DownloadData(metadata=ask))
    downloaded += [message async for message in stream if message.tensor_part.buffer]
    gather = DilocoAverager.serializer.dumps([None, 0, DilocoAverager.serializer.dumps({"peer": "stranger"})])
    request = averaging_pb2.JoinRequest(schema_hash=b"x", expiration=get_dht_time() + 5, gather=gather,
                                        group_key=f"{prefix}.0b")
    stream = await stub.rpc_join_group(request)
    answer = [message.code async for message in stream]
    return downloaded, answer


def test_run_secret_keeps_strangers_out(tmp_path, corpus):
    args = ["--data", str(corpus), "--inner-steps", "30", "--state-timeout", "3"]
    with LocalSwarm(tmp_path, config=TINY, extra_args=args, env={"P2PDILOCO_RUN_SECRET": SECRET}) as swarm:
        swarm.start("a")
        swarm.start("b", join="a")
        swarm.wait_for(lambda: all(len(swarm.events(n, "outer")) >= 2 for n in "ab"), timeout=120,
                       what="the protected swarm trains")
        # a peer with a wrong secret, and one with none, are refused with a clear error
        swarm.env["P2PDILOCO_RUN_SECRET"] = "wrong"
        swarm.start("w", join="a")
        del swarm.env["P2PDILOCO_RUN_SECRET"]
        swarm.start("n", join="a")
        assert swarm.wait_exit("w", timeout=60) == 2
        assert "wrong run secret" in swarm.stderr("w")
        assert swarm.wait_exit("n", timeout=60) == 2
        assert "pass its --run-secret" in swarm.stderr("n")

        # a modified client that skips that check and even learned the averaging namespace (from
        # the libp2p protocol names a peer advertises) calls the averaging RPCs of peer a directly
        prefix = Config.from_sources(TINY, {"run_secret": SECRET}).dht_prefix
        a_id = swarm.events("a", "inner")[0]["peer"]
        dht = hivemind.DHT(start=True, initial_peers=[swarm.maddr("a")], **LOOPBACK_DHT)
        try:
            # the run's DHT records are MACed: a reader without the key gets nothing usable
            future = dht.get(f"{prefix}_progress", latest=True, return_future=True)
            try:
                found = future.result(timeout=10)
            except Exception:  # hivemind fails to decode a MACed value (or times out): nothing read
                found = None
            assert found is None or not isinstance(found.value, dict)
            downloaded, answer = asyncio.run(asyncio.wait_for(_call_rpcs(dht, a_id, prefix), 30))
            assert downloaded == [], "state served to a stranger"
            assert answer == [averaging_pb2.PROTOCOL_VIOLATION], answer
        finally:
            dht.shutdown()
        t = time.time()
        swarm.wait_for(lambda: len([r for r in swarm.events("a", "outer") if r["time"] > t]) >= 2, timeout=60,
                       what="the swarm goes on")
        assert all(r["group_size"] == 2 for r in swarm.events("a", "outer"))
        # the secret is never written to the logs or the resolved config
        for name in "ab":
            assert SECRET not in (tmp_path / name / "config.json").read_text()
            assert SECRET not in (tmp_path / name / "metrics.jsonl").read_text()
            assert SECRET not in swarm.stderr(name, tail=10**6)
