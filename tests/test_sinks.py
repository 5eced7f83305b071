"""TensorBoard and W&B sinks: a real `p2pdiloco join` writes its inner scalars to a TensorBoard event
file (read back with tensorboard's EventAccumulator) and to an offline W&B run, and leaves no
wandb-core process behind; without sinks neither package is imported; a missing package is a
one-line error; a sink failing mid-run is dropped with one warning while metrics.jsonl goes on."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from p2pdiloco.config import ConfigError
from p2pdiloco.localswarm import LocalSwarm
from p2pdiloco.metrics import Metrics, read_metrics
from p2pdiloco.sinks import check_installed
from tests.conftest import ROOT, TINY

pytestmark = pytest.mark.timeout(180)


def wandb_core_pids(parent: int) -> list[int]:
    """wandb-core service processes started for the process `parent` (wandb passes `--pid PARENT`)."""
    found = subprocess.run(["pgrep", "-f", f"wandb-core.* --pid {parent}( |$)"], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def test_join_writes_tensorboard_and_wandb(tmp_path, corpus):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir, wandb_dir = tmp_path / "tb", tmp_path / "wandb"
    wandb_dir.mkdir()
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    with LocalSwarm(tmp_path, config=TINY, env=env) as swarm:
        try:
            peer = swarm.start("a", "--data", str(corpus), "--max-time", "3", "--log-interval", "0.5",
                               "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--tensorboard-dir", str(tb_dir),
                               "--wandb-project", "p", "--quiet")
            code = peer.proc.wait(timeout=120)
            left = wandb_core_pids(peer.proc.pid)
        finally:
            swarm.stop_all()
        assert code == 0, swarm.stderr("a")
        assert not left, f"wandb-core left running: {left}"
        assert "p2pdiloco: peer" not in swarm.stderr("a")  # --quiet: no status lines

    inner = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if r["event"] == "inner"]
    assert len(inner) >= 2, inner
    peer_id = inner[0]["peer"]

    # TensorBoard: one directory per peer, named by its id; inner/loss against inner_step
    assert [p.name for p in tb_dir.iterdir()] == [peer_id]
    events = EventAccumulator(str(tb_dir / peer_id))
    events.Reload()
    assert {"inner/loss", "inner/tokens_per_s"} <= set(events.Tags()["scalars"])
    scalars = events.Scalars("inner/loss")
    assert [s.step for s in scalars] == [r["inner_step"] for r in inner]
    assert [s.value for s in scalars] == pytest.approx([r["loss"] for r in inner], rel=1e-5)
    assert scalars[0].wall_time == pytest.approx(inner[0]["time"], abs=1e-2)

    # W&B: an offline run named by the peer id, its history in the run file
    runs = list((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    run_files = list(runs[0].glob("run-*.wandb"))
    assert len(run_files) == 1 and run_files[0].stat().st_size > 0
    assert peer_id.encode() in run_files[0].read_bytes()


def test_without_sinks_nothing_is_imported(tmp_path):
    code = ("import sys; from p2pdiloco.metrics import Metrics; import p2pdiloco.plot; "
            f"m = Metrics({str(tmp_path)!r}, 'p'); m.log('inner', inner_step=1, loss=2.0); m.close(); "
            "print(sorted(n for n in sys.modules if n.split('.')[0] in ('wandb', 'tensorboard', 'matplotlib') "
            "or n == 'torch.utils.tensorboard'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_missing_package_is_a_one_line_error(tmp_path, corpus):
    """A real `p2pdiloco join` where wandb cannot be imported: a stand-in that raises ImportError, as a
    missing package does, shadows it on PYTHONPATH. (The same path for tensorboard: the unit test below.)"""
    flag, package = "--wandb-project", "wandb"
    shadow = tmp_path / "shadow"
    (shadow / package).mkdir(parents=True)
    (shadow / package / "__init__.py").write_text(f"raise ImportError(\"No module named {package!r}\")\n")
    pythonpath = os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH", "")) if p)
    with LocalSwarm(tmp_path, config=TINY, env={"PYTHONPATH": pythonpath}) as swarm:
        try:
            peer = swarm.start("a", "--data", str(corpus), "--max-inner-steps", "1", "--host-maddrs",
                               "/ip4/127.0.0.1/tcp/0", flag, str(tmp_path / "x"))
            returncode = peer.proc.wait(timeout=90)
        finally:
            swarm.stop_all()
        stderr = swarm.stderr("a")
    assert returncode == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("p2pdiloco: peer")]
    assert lines == [f"p2pdiloco: error: {flag} needs the {package} package: pip install 'p2pdiloco[{package}]'"]


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_metrics_raise_config_error_for_a_missing_package(tmp_path, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # what `import` then raises: ImportError
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    sink = {"tensorboard_dir": str(tmp_path / "tb")} if package == "tensorboard" else {"wandb_project": "p"}
    with pytest.raises(ConfigError, match=f"needs the {package} package: pip install 'p2pdiloco\\[{package}\\]'"):
        Metrics(str(tmp_path / "log"), "p", **sink)
    assert not (tmp_path / "log").exists()  # nothing opened before the error
    # the peer asks the same before it joins the swarm (find_spec reports the package missing)
    with pytest.raises(ConfigError, match=f"needs the {package} package"):
        check_installed(**sink)
    other = {"wandb_project": "p"} if package == "tensorboard" else {"tensorboard_dir": str(tmp_path / "tb")}
    check_installed(**other)  # the other one is installed


def test_a_failing_sink_is_dropped_with_one_warning(tmp_path, caplog):
    """A unit test of the drop path: a TensorBoard sink whose writer breaks mid-run."""
    metrics = Metrics(str(tmp_path / "log"), "peer1", tensorboard_dir=str(tmp_path / "tb"))
    try:
        sink = metrics._sinks[0]

        def broken(*args, **kwargs):
            raise OSError(28, "No space left on device")

        sink.writer.add_scalar = broken
        with caplog.at_level(logging.WARNING, logger="p2pdiloco.metrics"):
            for step in (1, 2, 3):
                metrics.log("inner", inner_step=step, outer_step=0, loss=2.0, tokens=step, tokens_per_s=1.0)
        assert metrics._sinks == []
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "TensorBoard sink failed and is dropped" in warnings[0], warnings
    finally:
        metrics.close()
    records = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["inner_step"] for r in records] == [1, 2, 3]
