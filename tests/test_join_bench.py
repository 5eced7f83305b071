"""scripts/join_bench.py at its tiny size: a joiner and a frozen founder keep up with real peers,
each with one state download at most (its join) and none after waking."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(400)


def test_joiner_and_frozen_peer_keep_up_without_downloads(tmp_path, corpus):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "join_bench.py"), "--size", "tiny", "--duration",
                           "50", "--freeze", "--out", str(tmp_path), "--data", str(corpus)],
                          capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    joiner, frozen = result["joiner"], result["frozen"]
    assert joiner["downloads"] == 1, joiner          # its join, and no resync after it
    assert joiner["rounds_applied"] >= 2 and joiner["reference_rounds"] >= 2, joiner
    assert frozen["downloads_after_waking"] == 0, frozen
    assert frozen["rounds_applied"] >= 1, frozen
    assert all(code == 0 for code in result["exit_codes"].values()), result["exit_codes"]
    assert "joiner: applied" in proc.stdout and "frozen: applied" in proc.stdout
