"""The Python API end to end: examples/custom_model.py (an MLP with its own optimizer, data and
loss, wrapped by p2pdiloco.DiLoCo) run as real processes that form a swarm."""

from __future__ import annotations

import sys

import pytest

from p2pdiloco.localswarm import LocalSwarm
from tests.conftest import ROOT, TINY, evaluated

pytestmark = pytest.mark.timeout(240)

EXAMPLE = ROOT / "examples" / "custom_model.py"


def start_example(swarm: LocalSwarm, name: str, *args: str, join: str = ""):
    cmd = [sys.executable, str(EXAMPLE), "--log-dir", str(swarm.workdir / name),
           "--maddrs-file", str(swarm.workdir / f"{name}.maddrs"), *args]
    if join:
        cmd += ["--initial-peers", swarm.maddr(join)]
    return swarm.spawn(name, cmd)


def test_custom_model_trains_in_a_swarm(tmp_path):
    with LocalSwarm(tmp_path, config=TINY) as swarm:
        # both stop at the same outer step (bounded in time, whatever the machine's load)
        budget = ["--max-steps", "1000000", "--max-outer-steps", "6", "--max-time", "90"]
        start_example(swarm, "a", *budget)
        start_example(swarm, "b", "--seed", "2", *budget, join="a")
        # a peer of the same run with another model shape is refused with one line, exit 2
        start_example(swarm, "c", "--hidden", "32", "--max-steps", "100", join="a")
        assert swarm.wait_exit("c", timeout=60) == 2, swarm.stderr("c")
        last_line = swarm.stderr("c").strip().splitlines()[-1]
        assert last_line.startswith("custom_model: error: run 'custom-mlp' is training another model"), last_line

        assert swarm.wait_exit("a", timeout=120) == 0, swarm.stderr("a")
        assert swarm.wait_exit("b", timeout=60) == 0, swarm.stderr("b")
        for name in "ab":
            outer = swarm.events(name, "outer")
            assert len(outer) >= 3, swarm.stderr(name)
            assert all(r["group_size"] == 2 for r in outer), outer
            # the initial MLP scores 0.31 (as does predicting 0); the swarm's anchor learns the function
            assert evaluated(outer)[-1]["eval_loss"] < 0.15, outer
            final = swarm.events(name, "final")
            assert final and final[0]["tokens"] == 64 * final[0]["inner_step"], final
            assert final[0]["kept_eval_loss"] < 0.31, final  # the kept model (the anchors' average), by eval_fn
            assert swarm.events(name, "inner")[-1]["loss"] is not None
        # the eval_fn ran on the anchor: both peers report the same loss at the same outer step
        a_eval = {r["outer_step"]: r["eval_loss"] for r in evaluated(swarm.events("a", "outer"))}
        shared = [(a_eval[r["outer_step"]], r["eval_loss"]) for r in evaluated(swarm.events("b", "outer"))
                  if r["outer_step"] in a_eval]
        assert shared and all(abs(x - y) <= 0.01 * x + 1e-5 for x, y in shared), shared
