"""Metrics: one JSON object per line in `LOG_DIR/metrics.jsonl`, plus a human status line.

Events (the contract documented in the README):
    inner        every log interval: inner_step, outer_step, loss, tokens, tokens_per_s, compute_s, data_s,
                 outer_s (the trainer's seconds in starting and applying rounds), eval_s (evaluating the anchor)
    outer        each applied outer step: outer_step, group_size, share, weight, staleness, round_s,
                 bytes_sent, bytes_recv, eval_loss, eval_bpb (bits per byte of text), anchor_spread
    join         after a state download: loaded_outer_step, download_s
    round_failed a discarded round: reason
    resync       a state reload after divergence or staleness: reason, loaded_outer_step
    allreduce_started  the group formed and the all-reduce began: outer_step
    bad_contribution   our reducer excluded or clipped a sender's parts: sender, reason
    resume       restarted from a checkpoint: outer_step, inner_step
    data         a range of claimed windows read (prepared tokens): epoch, shard, start, end (cursors)
    checkpoint_failed  a checkpoint write failed (the previous one is kept): reason
    final        at a clean stop: inner_step, outer_step, eval_loss, eval_bpb (the anchor), kept_eval_loss,
                 kept_eval_bpb (the model the peer keeps: its anchors' average, with anchor_average > 0),
                 tokens, compute_s, data_s, outer_s, eval_s, wall_s, final_wait_s

The inner and outer scalars also go to TensorBoard and W&B when asked for (sinks.py). A sink that
fails while training logs one warning and is dropped; metrics.jsonl and training go on.

    >>> metrics = Metrics("runs/a", peer_id, tensorboard_dir="runs/tb")
    >>> metrics.log("inner", inner_step=120, outer_step=2, loss=2.31, ...)
    >>> metrics.close()
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)


class Metrics:
    def __init__(self, log_dir: Optional[str], peer: str, quiet: bool = False, *, tensorboard_dir: str = "",
                 wandb_project: str = "", run_config: Optional[dict] = None):
        self.peer = peer
        self.quiet = quiet
        self._file = None
        self._lock = threading.Lock()  # the round thread logs too
        self._sinks = []
        if tensorboard_dir or wandb_project:
            from p2pdiloco.sinks import open_sinks  # imports tensorboard / wandb: only when asked for

            self._sinks = open_sinks(peer=peer, tensorboard_dir=tensorboard_dir, wandb_project=wandb_project,
                                     run_config=run_config, log_dir=log_dir)
        if log_dir:
            try:
                Path(log_dir).mkdir(parents=True, exist_ok=True)
                self._file = open(Path(log_dir) / "metrics.jsonl", "a", buffering=1)
            except BaseException:
                self.close()
                raise

    def log(self, event: str, **fields: Any) -> None:
        if self._file is None and not self._sinks:
            return
        record = {"event": event, "time": round(time.time(), 3), "peer": self.peer}
        record.update({k: _clean(v) for k, v in fields.items()})
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(record) + "\n")
            if self._sinks:
                self._to_sinks(event, record)

    def _to_sinks(self, event: str, record: dict) -> None:
        from p2pdiloco.sinks import scalars

        found = scalars(event, record)
        if found is None:
            return
        step, values = found
        for sink in list(self._sinks):
            try:
                sink.write(event, step, values, walltime=record["time"])
            except Exception as e:  # a full disk, a dead W&B service: the run matters more than the sink
                logger.warning(f"the {sink.name} sink failed and is dropped (metrics.jsonl goes on): {e!r}")
                self._sinks.remove(sink)
                _close_quietly(sink)

    def status(self, line: str) -> None:
        if not self.quiet:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            sinks, self._sinks = self._sinks, []
        for sink in sinks:
            _close_quietly(sink)


def _close_quietly(sink) -> None:
    try:
        sink.close()
    except Exception as e:  # closing is best effort: the peer is stopping or already dropped it
        logger.warning(f"closing the {sink.name} sink failed: {e!r}")


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6) if math.isfinite(value) else None
    return value


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a metrics.jsonl (a torn last line, from a killed peer, is skipped). The anchor is
    evaluated in the background, after its `outer` record was written: each `eval` record's loss is also
    set on the `outer` record of the same outer step (eval_loss None where none was evaluated)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return fold_evals(records)


def fold_evals(records: list[dict]) -> list[dict]:
    """Set each `eval` record's eval_loss and eval_bpb on the last `outer` record of its outer step."""
    outer_at = {}
    for r in records:
        if r.get("event") == "outer":
            r.setdefault("eval_loss", None)
            r.setdefault("eval_bpb", None)
            outer_at[r.get("outer_step")] = r
        elif r.get("event") == "eval" and r.get("outer_step") in outer_at:
            outer_at[r["outer_step"]].update(eval_loss=r.get("eval_loss"), eval_bpb=r.get("eval_bpb"))
    return records
