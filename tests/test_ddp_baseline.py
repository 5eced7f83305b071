"""The DDP baseline (scripts/ddp_baseline.py) really trains data-parallel: two gloo ranks learn, end with
bit-identical weights (their batches differ, so only all-reduced gradients keep them equal), and no
worker outlives the launcher."""

from __future__ import annotations

import math
import os
import sys

import pytest

from tests.conftest import ROOT, TINY

sys.path.insert(0, str(ROOT / "scripts"))
from ddp_baseline import run_ddp

pytestmark = pytest.mark.timeout(120)


def test_two_ranks_learn_and_stay_identical(tmp_path, corpus):
    result = run_ddp(tmp_path, world_size=2, config=TINY, steps=30, timeout=90,
                     overrides={"threads": 1, "eval_batches": 2, "data": str(corpus)})

    finals = [[r for r in records if r["event"] == "final"] for records in result["ranks"]]
    assert [len(f) for f in finals] == [1, 1], finals
    f0, f1 = finals[0][0], finals[1][0]
    assert result["final"] == f0
    assert f0["inner_step"] == f1["inner_step"] == 30
    assert f0["tokens"] == 2 * 30 * 16 * 64  # global: world_size x batch_size x block_size per step
    assert f0["eval_loss"] is not None and math.isfinite(f0["eval_loss"])
    assert f0["eval_loss"] < math.log(256) - 0.5, f0  # an untrained byte model sits at ln(256) = 5.55
    assert f0["param_sum_hex"] == f1["param_sum_hex"], (f0, f1)
    assert f0["eval_loss"] == f1["eval_loss"]
    assert f0["wall_s"] > 0 and f0["step_s_mean"] > 0

    for pid in result["pids"]:  # reaped by the launcher, so not even a zombie remains
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
