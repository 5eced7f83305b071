"""scripts/data_bench.py at tiny sizes (its numbers are in docs/data.md): every benchmark runs and
prints the figures the docs quote."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from p2pdiloco.data.prepare import prepare
from tests.conftest import ROOT, make_corpus

pytestmark = pytest.mark.timeout(240)


def bench(*args, timeout=180) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "data_bench.py"), *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_prepare_loader_and_memory_benchmarks_print_their_figures(tmp_path, corpus):
    r = bench("prepare", "--mb", "1", "--vocab", "600", "--shard-mb", "0.5", "--text", str(corpus), "--tmp",
              str(tmp_path))
    assert r["ratio"] > 0 and abs(r["tokens"] - r["bare_tokens"]) <= 0.01 * r["tokens"]  # + EOTs
    assert r["prepare_tokens_s_per_core"] > 0 and r["bare_tokens_s_per_core"] > 0
    r = bench("loader", "--mb", "2", "--seconds", "0.3", "--tmp", str(tmp_path))
    assert r["tokens_per_s"] > 0 and r["batches"] > 0
    r = bench("memory", "--big-gb", "0.02", "--batches", "100", "--join-seconds", "0", "--tmp", str(tmp_path))
    assert {"loader_pread_growth_mb", "loader_mmap_growth_mb"} <= set(r) and len(r["rows"]) == 4


def test_coverage_benchmark_with_a_peer_holding_only_the_manifest(tmp_path):
    make_corpus(tmp_path / "c.txt", size=300_000, seed=2)
    prepare([str(tmp_path / "c.txt")], tmp_path / "tokens", tokenizer="bytes", shard_mb=0.05, eval_fraction=0.05,
            workers=1, progress=lambda _: None)
    r = bench("coverage", "--peers", "3", "--duration", "6", "--manifest-only", "1", "--data", str(tmp_path / "tokens"),
              "--workdir", str(tmp_path / "run"))
    assert r["epochs_read"] > 0 and r["per_epoch"] and r["twice_pct_max"] is not None
    peers = r["per_peer"]
    assert peers["p2"]["fetches"] > 0 and peers["p0"]["fetches"] == peers["p1"]["fetches"] == 0, peers
    assert all(p["data_wait_pct"] >= 0 for p in peers.values())
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "data_bench.py"), "coverage", "--data", "x",
                           "--peers", "2", "--manifest-only", "2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--manifest-only must be below --peers" in proc.stderr
