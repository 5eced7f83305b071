"""Checkpoints: atomic writes, corruption detected with the previous file used, foreign files refused,
a full disk keeps the previous checkpoint; and the CLI's one-line errors for each."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from p2pdiloco.checkpoint import (CheckpointError, checkpoint_paths, ensure_writable, load_latest, read_checkpoint,
                                  save_checkpoint)
from p2pdiloco.config import Config
from tests.conftest import TINY

pytestmark = pytest.mark.timeout(120)

CFG = Config(run_id="ck")


def payload(step: int, cfg: Config = CFG) -> dict:
    return {"run_id": cfg.run_id, "fingerprint": cfg.fingerprint(), "outer_step": step,
            "anchor": torch.full((10,), float(step)), "momentum": torch.zeros(10), "local": torch.ones(10)}


def test_round_trip_and_only_the_last_two_kept(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, payload(step), outer_step=step)
    assert [p.name for p in checkpoint_paths(tmp_path)] == ["ckpt-00000003.pt", "ckpt-00000002.pt"]
    loaded, path, problems = load_latest(tmp_path, CFG)
    assert loaded["outer_step"] == 3 and problems == []
    torch.testing.assert_close(loaded["anchor"], torch.full((10,), 3.0))
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_newest_falls_back_to_previous(tmp_path, damage):
    save_checkpoint(tmp_path, payload(1), outer_step=1)
    newest = save_checkpoint(tmp_path, payload(2), outer_step=2)
    raw = bytearray(newest.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw[-100] ^= 0xFF
    newest.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_checkpoint(newest)
    loaded, path, problems = load_latest(tmp_path, CFG)
    assert loaded["outer_step"] == 1 and path.name == "ckpt-00000001.pt"
    assert len(problems) == 1 and "checksum mismatch" in problems[0]


def test_all_corrupt_or_foreign_is_an_error(tmp_path):
    (tmp_path / "ckpt-00000005.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        load_latest(tmp_path, CFG)
    other = tmp_path / "other"
    save_checkpoint(other, payload(4, Config(run_id="ck", n_embd=32)), outer_step=4)
    with pytest.raises(CheckpointError, match="belongs to run"):
        load_latest(other, CFG)


def test_disk_full_keeps_the_previous_checkpoint(tmp_path):
    previous = save_checkpoint(tmp_path, payload(1), outer_step=1)
    # the temp file of the next write lands on /dev/full: the kernel answers ENOSPC
    (tmp_path / "ckpt-00000002.pt.tmp").symlink_to("/dev/full")
    with pytest.raises(OSError) as info:
        save_checkpoint(tmp_path, payload(2), outer_step=2)
    assert info.value.errno == 28  # ENOSPC
    assert checkpoint_paths(tmp_path) == [previous]
    assert load_latest(tmp_path, CFG)[0]["outer_step"] == 1
    assert not (tmp_path / "ckpt-00000002.pt.tmp").exists()


def test_unwritable_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="not writable"):
        ensure_writable(blocker / "ckpt")


def run_join(*args):
    return subprocess.run([sys.executable, "-m", "p2pdiloco", "join", "--config", TINY, *args],
                          capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("case", ["foreign", "corrupt", "unwritable"])
def test_cli_refuses_bad_checkpoint_dirs_with_one_line(tmp_path, corpus, case):
    ckpt = tmp_path / "ckpt"
    cfg = Config.from_sources(TINY)
    if case == "foreign":
        save_checkpoint(ckpt, payload(3, Config.from_sources(TINY, {"n_layer": 3})), outer_step=3)
        expected = "belongs to run"
    elif case == "corrupt":
        ckpt.mkdir()
        (ckpt / "ckpt-00000003.pt").write_bytes(os.urandom(5000))
        expected = "no usable checkpoint"
    else:
        (tmp_path / "file").write_text("x")
        ckpt = tmp_path / "file" / "ckpt"
        expected = "not writable"
    before = sorted(p.name for p in checkpoint_paths(ckpt))
    proc = run_join("--data", str(corpus), "--checkpoint-dir", str(ckpt), "--max-time", "1")
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("p2pdiloco: error")]
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in checkpoint_paths(ckpt)) == before, "nothing lost or overwritten"
    assert cfg.run_id == "tiny"
