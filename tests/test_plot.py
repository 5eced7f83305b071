"""`p2pdiloco plot`: three peers' metrics.jsonl files (the README's event contract) become one PNG;
the series behind the panels; labels and title; and the one-line errors (exit 2) for a dir without metrics.jsonl, no
records, an unwritable output and a missing matplotlib."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from p2pdiloco import plot
from p2pdiloco.cli import build_parser
from p2pdiloco.metrics import read_metrics
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(120)


def write_peer(log_dir: Path, peer: str, *, t0: float, joined: bool, restart_at: int = 0) -> None:
    """A peer's metrics.jsonl as the trainer writes it (README "Metrics"): an inner record every
    second, an outer step every 4 s; joined: it starts with a state download; restart_at: a second
    process (a new peer id) appends from that second on."""
    log_dir.mkdir(parents=True)
    lines = []

    def log(second: int, event: str, **fields) -> None:
        lines.append(json.dumps({"event": event, "time": t0 + second,
                                 "peer": peer if second < restart_at or not restart_at else peer + "-2", **fields}))

    for s in range(1, 25):
        if s == restart_at:
            log(s, "resume", outer_step=s // 4, inner_step=s * 25)
        log(s, "inner", inner_step=s * 25, outer_step=s // 4, loss=5.5 / (1 + s / 4), tokens=s * 25 * 1024,
            tokens_per_s=25_600.0, compute_s=s * 0.9)
        if joined and s == 1:
            log(s, "join", loaded_outer_step=0, download_s=0.2)
        if s % 4 == 0:
            log(s, "outer", outer_step=s // 4, group_size=3 if s < 12 else 2, share=1.0, weight=1.0,
                tokens=4 * 25 * 1024, staleness=0, round_s=1.1, bytes_sent=160_000 + s, bytes_recv=161_000,
                eval_loss=5.0 / (1 + s / 4) if s != 8 else None, anchor_spread=0.0, diverged_members=0)
        if s == 14:
            log(s, "round_failed", reason="no group", outer_step=3, round_s=2.0)
        if s == 18:
            log(s, "resync", reason="4 outer steps behind the swarm", loaded_outer_step=5, download_s=0.3)
    (log_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


@pytest.fixture
def swarm_logs(tmp_path) -> list[Path]:
    t0 = 1_700_000_000.0
    dirs = [tmp_path / name for name in ("a", "b", "c")]
    write_peer(dirs[0], "peer-a", t0=t0, joined=False)
    write_peer(dirs[1], "peer-b", t0=t0 + 3, joined=True, restart_at=10)
    write_peer(dirs[2], "peer-c", t0=t0 + 5, joined=True)
    return dirs


def run_plot(*args: str) -> int:
    return plot.run(build_parser().parse_args(["plot", *args]))


def test_cli_writes_one_png(tmp_path, swarm_logs):
    out = tmp_path / "swarm.png"
    proc = subprocess.run([sys.executable, "-m", "p2pdiloco", "plot", *map(str, swarm_logs), "-o", str(out),
                           "--title", "three peers"], capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    records = sum(len(read_metrics(d / "metrics.jsonl")) for d in swarm_logs)
    assert proc.stdout.strip() == f"p2pdiloco: wrote {out} (3 peers, {records} records)"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(out).shape[:2] == (900, 1600)


def test_series(swarm_logs):
    records = read_metrics(swarm_logs[1] / "metrics.jsonl")
    t0 = records[0]["time"] - 1
    d = plot.curves(records, t0)
    inner = d["inner"]
    # the restart (a new peer id in the same file) breaks the line: one NaN row between the segments
    gaps = [i for i, t in enumerate(inner["t"]) if math.isnan(t)]
    assert len(gaps) == 1 and inner["t"][gaps[0] - 1] == 9 and inner["t"][gaps[0] + 1] == 10
    # eval losses at the tokens the peer had when they were measured; the skipped eval is a gap
    outer = d["outer"]
    assert outer["outer_step"] == [1, 2, 3, 4, 5, 6]
    assert outer["tokens"] == [s * 25 * 1024 for s in (4, 8, 12, 16, 20, 24)]
    assert math.isnan(outer["eval_loss"][1]) and outer["eval_loss"][0] == pytest.approx(2.5)
    # the outer-step line: inner records, outer steps, the join (0) and the resync (to 5)
    assert (18, 5) in zip(d["steps"]["t"], d["steps"]["outer_step"])
    assert d["resync"] == {"t": [18], "outer_step": [5]}
    assert d["failed"] == {"t": [14], "outer_step": [3]}


def test_labels_and_title(tmp_path, swarm_logs):
    (swarm_logs[0] / "config.json").write_text('{"run_id": "tiny"}')
    assert plot.default_title([str(swarm_logs[0])]) == "p2pdiloco run 'tiny'"
    assert plot.default_title([str(d) for d in swarm_logs]) == "p2pdiloco metrics"  # b and c have no config.json
    other = tmp_path / "runs2" / "a"
    write_peer(other, "peer-x", t0=1_700_000_000.0, joined=False)
    assert [label for label, _ in plot.load([str(swarm_logs[0]), str(other)])] == [str(swarm_logs[0]), str(other)]


@pytest.mark.parametrize("case, message", [
    ("no dir", "{d} has no metrics.jsonl (pass the --log-dir of a peer)"),
    ("no metrics.jsonl", "{d} has no metrics.jsonl (pass the --log-dir of a peer)"),
    ("no records", "no records to plot in {d}"),
    ("output dir missing", "cannot write {out}: No such file or directory"),
    ("output under a file", "cannot write {out}: Not a directory"),
    ("unknown format", "cannot write {out}: Format 'unknownformat' is not supported"),
])
def test_errors_are_one_line_with_exit_2(tmp_path, swarm_logs, capsys, case, message):
    d, out = swarm_logs[0], tmp_path / "out.png"
    if case == "no dir":
        d = tmp_path / "nothing-here"
    elif case == "no metrics.jsonl":
        (d / "metrics.jsonl").unlink()
    elif case == "no records":
        (d / "metrics.jsonl").write_text("")
    elif case == "output dir missing":
        out = tmp_path / "no-such-dir" / "out.png"
    elif case == "output under a file":
        out = d / "metrics.jsonl" / "out.png"
    else:
        out = tmp_path / "out.unknownformat"
    assert run_plot(str(d), "-o", str(out)) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(f"p2pdiloco: error: {message.format(d=d, out=out)}"), err
    assert len([line for line in err.splitlines() if "error" in line]) == 1 and "Traceback" not in err


def test_a_dir_without_records_is_left_out(tmp_path, swarm_logs, capsys):
    empty = tmp_path / "starting"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    assert run_plot(str(swarm_logs[0]), str(empty), "-o", str(tmp_path / "out.png")) == 0
    captured = capsys.readouterr()
    assert "holds no records yet; left out" in captured.err
    assert "(1 peer, " in captured.out


def test_missing_matplotlib(tmp_path, swarm_logs):
    """A stand-in package that raises ImportError, as a missing one does, shadows matplotlib (in a
    fresh interpreter; plot.run without the CLI around it, which would import torch for nothing)."""
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(shadow.parent), os.environ.get("PYTHONPATH")]))}
    code = ("import argparse, sys; from p2pdiloco import plot; parser = argparse.ArgumentParser(); "
            "plot.add_arguments(parser); sys.exit(plot.run(parser.parse_args(sys.argv[1:])))")
    proc = subprocess.run([sys.executable, "-c", code, str(swarm_logs[0]), "-o", str(tmp_path / "x.png")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["p2pdiloco: error: plot needs matplotlib: pip install 'p2pdiloco[plot]'"]
    assert not (tmp_path / "x.png").exists()
