"""Issues 11 and 36 at the suite's size (scripts/scale.py; the 85M numbers are in docs/scale.md): memory
per process of real peers, joins that take the state from several sources at once, a source that
dies mid-download, a SIGTERM during a download, and 8 peers in whole groups at a small ratio. Where
network namespaces are missing the throttled join must say why on one line and exit 2 — that is
asserted instead, never skipped."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from p2pdiloco.data.prepare import prepare
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import scale  # noqa: E402
from netns import available  # noqa: E402

NETNS_OK, WHY = available()


def test_a_line_is_whole_when_it_holds_every_used_cell():
    """7 peers, target 4: a 4 x 2 grid (grid.sides), cells 0-6 used. Along dimension 0 the line of (0, 1)
    holds cells 4-6 only, so a group of 3 there is whole, and the line of (0, 0) holds 4, so a group of 3
    is not; along dimension 1 the line of (0, 0) holds cells 0 and 4. With one dimension, every live
    peer up to the target."""
    rounds = [{"grid": [0, 2, [0, 1]], "group_size": 3}, {"grid": [0, 2, [0, 0]], "group_size": 3},
              {"grid": [1, 2, [0, 0]], "group_size": 2}, {"grid": [2, 1, [5]], "group_size": 3},
              {"group_size": 8}]  # no grid field: not counted
    assert scale.line_whole_share(rounds, size=7, target=4) == pytest.approx(2 / 4)
    assert scale.line_whole_share([], size=8, target=4) is None
    assert scale.line_whole_share([{"grid": [0, 1, [3]], "group_size": 8}], size=16, target=8) == 1.0


@pytest.mark.timeout(300)
def test_scale_peers_measures_every_process(tmp_path, corpus):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "scale.py"), "peers", "--size", "tiny",
                           "--duration", "10", "--away", "12", "--data", str(corpus), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["founder_rounds"] > 0 and result["join_download_s"] > 0, result
    for name in "abc":
        row = result["memory"][name]
        for role in ("trainer", "averager", "dht", "p2pd"):
            assert row[role]["peak_mb"] > 0, (name, role, row)
        # the forked children no longer carry the trainer's model: far below the trainer's own share
        assert row["dht"]["steady_mb"] < 400 and row["total"]["peak_mb"] < result["target_mb_per_peer"], row
    assert "peak PSS MB" in proc.stdout and "target per peer" in proc.stdout
    # the joiner, SIGSTOPped after its first round, came back through a merge round (the memory's worst case)
    assert result["merge_rounds"]["c"] >= 1 and "merge rounds:" in proc.stdout, result["merge_rounds"]
    for name in "abc":
        assert "Traceback" not in (tmp_path / "peers" / f"{name}.stderr").read_text(), name


@pytest.mark.timeout(300)
def test_a_join_takes_chunks_from_every_source(tmp_path, corpus):
    """The state from 3 sources, and (the joiner holding only the manifest) shards from them too."""
    tokens = tmp_path / "tokens"
    prepare([str(corpus)], tokens, tokenizer="bytes", shard_mb=0.05, workers=1, progress=lambda _: None)
    r = scale.run_join("tiny", 3, 1, tmp_path / "peers", data=str(tokens), manifest_only=True)
    (join,) = r["joins"]
    assert join["sources"] == 3 and join["exit_code"] == 0 and not join["traceback"], r
    train = [f for f in join["fetches"] if f["shard"].startswith("train")]
    # one per shard read (a swarm of more slots than shards may read one shard in two epochs at once)
    assert train and all(f["sources"] >= 2 for f in train) and join["fetch_vs_state"] > 0, join


def test_a_swarm_behind_a_bad_rate_is_refused_before_any_peer_starts(tmp_path):
    for rate in ("-1", "nan"):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "scale.py"), "swarm", "--sizes", "8",
                               "--rate-mbit", rate, "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "--rate-mbit must be >= 0" in proc.stderr.strip().splitlines()[-1], proc.stderr
        assert not (tmp_path / "swarm-8").exists()


@pytest.mark.timeout(420)
def test_a_source_leaves_mid_download_and_a_stop_interrupts_one(tmp_path, corpus):
    if not NETNS_OK:
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "scale.py"), "join", "--size", "small",
                               "--rate-mbit", "20"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert WHY in proc.stderr
        return
    # 3 sources behind 20 Mbit/s each: a 62 MB state takes ~8 s, so the kill lands mid-download
    r = scale.run_join("small", 3, 1, tmp_path / "peers", rate_mbit=20, data=str(corpus), leave=True, stop=True)
    (join,) = r["joins"]
    assert join["source_killed"] and join["exit_code"] == 0 and not join["traceback"], r
    assert join["download_s"] is not None and join["sources"] >= 2, r
    stopped = r["stopped"]
    assert not stopped["joined_first"], r  # the SIGTERM came while it downloaded ...
    assert stopped["exit_s"] <= 10 and stopped["exit_code"] == 0 and not stopped["traceback"], r  # ... and was honoured


@pytest.mark.timeout(400)
def test_eight_peers_at_a_small_ratio_average_in_whole_groups(tmp_path, corpus):
    """8 real peers where a contribution (H = 8 steps, paced 3x) takes about as long as a round (the ratio
    is measured: it must be small for the test to mean anything) still average in groups that hold all
    8 (docs/scale.md, "Whole groups as the ratio falls"). Under the mean: at H = 8 the robust rule bans
    honest peers, which splits any swarm (the same page, "at a small H the robust rule bans honest peers")."""
    r = scale.run_swarm(8, 60, tmp_path / "swarm-8", slowdown=3, data=str(corpus), target_group=8, inner_steps=8,
                        aggregation="mean")
    assert r["ratio"] is not None and r["ratio"] < 3.5, r
    assert r["applied_rounds"] >= 8 * 15 and r["full_share"] >= 0.8, r
    assert r["entry_spread_median"] is not None and r["entry_spread_median"] < 1.0, r  # one round, one moment
    assert r["bans"] == 0 and all(code == 0 for name, code in r["exit_codes"].items() if name != "boot"), r


@pytest.mark.timeout(400)
def test_swarm_sizes_are_measured_on_a_grid(tmp_path, corpus):
    """4 real peers with target_group_size 2: a 2 x 2 grid (p2pdiloco/grid.py). Groups stay at 2, and
    each peer meets more than one other (the lines rotate), so every anchor gets everyone's work. The
    DHT's bytes are counted by key as well (--dht-breakdown: scripts/dhtcount)."""
    results = [scale.run_swarm(4, 45, tmp_path / "swarm-4", slowdown=4, data=str(corpus), target_group=2,
                               dht_breakdown=True)]
    for r in results:
        assert r["applied_rounds"] > 0 and r["group_size_max"] == 2, r
        assert r["partners_min"] >= 2, r
        assert r["spread_median"] is not None and 0 <= r["spread_median"] < 1, r
        assert r["dht_kb_per_peer_round"] is not None and r["dht_kb_per_peer_round"] > 0, r
        # the peers' own step rate, simulate.py --compare's input: paced 4x, a tiny peer's tens of steps/s
        assert 0.5 < r["steps_per_s_median"] < 30, r
        assert all(code == 0 for name, code in r["exit_codes"].items() if name != "boot"), r
        served = r["dht_breakdown"]["bytes"]  # every kind of key a round and the schedule use was served
        assert all(served.get(kind, 0) > 0 for kind in ("find progress records", "find matchmaking (group keys)",
                                                         "find verdicts", "store progress records")), served
    scale.print_swarm(results)
    scale.print_dht_breakdown(results)
    scale.plot_swarm(results, tmp_path / "swarm.png")
    assert (tmp_path / "swarm.png").stat().st_size > 0


@pytest.mark.timeout(300)
def test_soak_samples_every_process_under_churn(tmp_path, corpus):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--duration", "30", "--sample-every",
                           "3", "--fault-every", "10", "--warmup", "5", "--min-span", "10", "--data", str(corpus),
                           "--workdir", str(tmp_path / "soak"), "--plot", str(tmp_path / "soak.png")],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "soak" / "soak.json").read_text())
    assert result["faults"] >= 1 and result["longest_stall_s"] is not None, result["chaos"]
    roles = {p["role"] for p in result["processes"]}
    assert roles == {"trainer", "averager", "dht", "p2pd"}, result["processes"]
    assert all(p["fds_last"] > 0 for p in result["processes"])
    assert result["tmp_counts"] and (tmp_path / "soak.png").stat().st_size > 0
    assert "worst slope" in proc.stdout
