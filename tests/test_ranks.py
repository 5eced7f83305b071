"""A peer that owns several devices: `torchrun --nproc-per-node 2 -m p2pdiloco join ...` (gloo on
CPU here). Rank 0 talks to the swarm; rank 1 trains with it under DDP and gets the new weights by
broadcast after every outer step. The torchrun peer averages with an ordinary peer."""

from __future__ import annotations

import sys

import pytest

from p2pdiloco.localswarm import LocalSwarm
from tests.conftest import TINY, evaluated

pytestmark = pytest.mark.timeout(240)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python"]


def test_torchrun_peer_in_a_two_peer_swarm(tmp_path, corpus):
    env = {"GLOO_SOCKET_IFNAME": "lo"}  # the ranks talk over loopback only
    args = ["--data", str(corpus), "--inner-steps", "30", "--threads", "1", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    with LocalSwarm(tmp_path, config=TINY, extra_args=args, env=env) as swarm:
        swarm.start("a")
        swarm.start("b", "--max-inner-steps", "240", join="a", wrapper=TORCHRUN)
        assert swarm.wait_exit("b", timeout=180) == 0, swarm.stderr("b")

        outer = swarm.events("b", "outer")
        assert len(outer) >= 2, swarm.stderr("b")
        assert all(r["group_size"] == 2 for r in outer), outer
        # every applied round moves the outer step: the ranks' per-step sync once wrote the leader's old
        # value back over the one its round's thread had just set (outer steps 1, 2, 2, 4, 4 in CI)
        steps = [r["outer_step"] for r in outer]
        assert steps == sorted(set(steps)), steps
        final = swarm.events("b", "final")[0]
        # one peer, two ranks: tokens count both ranks' batches (16 x 64 each per step)
        assert final["ranks"] == 2 and final["tokens"] == 240 * 2 * 16 * 64, final
        # rank 1 holds exactly rank 0's weights after the last broadcast
        assert final["rank_spread"] == 0.0, final
        assert final["eval_loss"] < 4.0, final
        # the torchrun peer and the plain one share the anchor: same eval loss at the same outer step
        a_eval = {r["outer_step"]: r["eval_loss"] for r in evaluated(swarm.events("a", "outer"))}
        shared = [(a_eval[r["outer_step"]], r["eval_loss"]) for r in evaluated(outer) if r["outer_step"] in a_eval]
        assert shared and all(abs(x - y) < 0.02 for x, y in shared), shared
        # only rank 0 joined the DHT: b's log holds one peer id
        assert len({r["peer"] for r in swarm.events("b")}) == 1
