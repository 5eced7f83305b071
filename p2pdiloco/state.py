"""The outer state a peer shares with joiners, and its download.

Shared state = (metadata, [anchor, momentum]): metadata holds `outer_step`, the config
`fingerprint` and `run_id`. A joiner keeps `allow_state_sharing=False` until it has loaded, so it
never advertises its random init; peers advertise `state_sharing_priority = outer_step`, so
hivemind downloads from the most advanced peer first.

The bytes arrive inside hivemind's averager process, out of our sight: the progress bar (on a
terminal) shows the elapsed time and the attempt; the caller's status line gives the size after.

    >>> state = download_state(averager, cfg, numel, timeout=30)   # None if nobody shares state
    >>> state.outer_step, state.anchor, state.momentum
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from p2pdiloco.progress import above_bars, bar, ticking

logger = logging.getLogger(__name__)


@dataclass
class OuterState:
    outer_step: int
    anchor: torch.Tensor
    momentum: torch.Tensor
    download_s: float = 0.0


def make_metadata(cfg, outer_step: int) -> dict:
    return {"outer_step": int(outer_step), "fingerprint": cfg.fingerprint(), "run_id": cfg.run_id}


def validate_state(metadata, tensors, cfg, numel: int) -> OuterState:
    """Check a downloaded state; raise ValueError with the reason if it is not usable."""
    if not isinstance(metadata, dict):
        raise ValueError("metadata is not a dict")
    if metadata.get("fingerprint") != cfg.fingerprint() or metadata.get("run_id") != cfg.run_id:
        raise ValueError(f"state is from another run or model config ({metadata.get('run_id')!r}, "
                         f"{metadata.get('fingerprint')!r})")
    outer_step = metadata.get("outer_step")
    if not isinstance(outer_step, int) or isinstance(outer_step, bool) or outer_step < 0:
        raise ValueError(f"bad outer_step {outer_step!r}")
    if len(tensors) != 2:
        raise ValueError(f"expected 2 tensors (anchor, momentum), got {len(tensors)}")
    anchor, momentum = (t.detach().float().reshape(-1) for t in tensors)
    for name, t in (("anchor", anchor), ("momentum", momentum)):
        if t.numel() != numel:
            raise ValueError(f"{name} has {t.numel()} values, the model {numel}")
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} is not finite")
    return OuterState(outer_step=outer_step, anchor=anchor.clone(), momentum=momentum.clone())


def best_shared_outer_step(dht, cfg) -> float:
    """The highest outer step that a peer currently offers for download (-1 if none)."""
    found = dht.get(f"{cfg.dht_prefix}.all_averagers", latest=True)
    if found is None or not isinstance(found.value, dict):
        return -1.0
    steps = [v.value for v in found.value.values() if isinstance(v.value, (int, float))]
    return max(steps, default=-1.0)


def download_state(averager, cfg, numel: int, *, timeout: float, min_outer_step: int = 0, progress=None,
                   stop_event=None) -> Optional[OuterState]:
    """Download the outer state from the most advanced peer that shares it, retrying until `timeout`.

    min_outer_step: wait until some peer offers at least this outer step (a member that left a round
    diverged waits for the others to apply it). Returns None if no usable state came in time."""
    shown = bar("p2pdiloco: downloading the swarm's state", unit="", bar_format="{desc}: {elapsed}{postfix}")
    with ticking(shown):
        return _download(averager, cfg, numel, timeout=timeout, min_outer_step=min_outer_step, progress=progress,
                         stop_event=stop_event, shown=shown)


def _download(averager, cfg, numel: int, *, timeout: float, min_outer_step: int, progress, stop_event,
              shown) -> Optional[OuterState]:
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        if stop_event is not None and stop_event.is_set():
            return None
        attempt += 1
        shown.set_postfix_str(f"attempt {attempt}" if min_outer_step <= 0 else
                              f"attempt {attempt}, waiting for outer step {min_outer_step}", refresh=False)
        t0 = time.monotonic()
        if min_outer_step > 0 and best_shared_outer_step(averager.dht, cfg) < min_outer_step:
            result = None
        else:
            try:
                result = averager.load_state_from_peers(timeout=max(1.0, min(cfg.state_timeout, deadline - t0)))
            except Exception as e:  # a timeout or a broken stream: try again while time is left
                logger.info(f"state download attempt {attempt} failed: {e!r}")
                result = None
        if result is not None:
            metadata, tensors = result
            try:
                state = validate_state(metadata, tensors, cfg, numel)
                state.download_s = time.monotonic() - t0
                if state.outer_step >= min_outer_step:
                    return state
            except ValueError as e:
                logger.warning(f"rejected a downloaded state: {e}")
        if time.monotonic() + 0.5 >= deadline:
            return None
        if progress is not None and attempt == 1:
            with above_bars():
                progress("p2pdiloco: no peer shares state yet, retrying ...")
        time.sleep(0.25 if min_outer_step > 0 else 1.0)
