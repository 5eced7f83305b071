"""One peer of the swarm: the inner loop, read top to bottom, and the outer step when a round returns.

    >>> peer = Peer(cfg)
    >>> peer.run()             # until SIGINT/SIGTERM, max_time or max_inner_steps; stops its children

The loop never waits for the network: every `inner_steps` steps it hands the pseudo-gradient to a
background round (RoundRunner) and keeps training; when the round's future is done it applies one
outer step (or discards the round) and goes on.
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import math
import os
import signal
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from p2pdiloco import checkpoint, diloco, sinks, state, swarm
from p2pdiloco.averaging import DilocoAverager, RoundOutcome, RoundRunner, contribution_weight, quiet_lonely_rounds
from p2pdiloco.data import load_data
from p2pdiloco.metrics import Metrics
from p2pdiloco.ranks import Ranks
from p2pdiloco.model import build_model, flat_params, load_flat_, num_params

logger = logging.getLogger(__name__)


# Test-only: make this peer corrupt its own outgoing pseudo-gradient ("nan", "inf" or "huge"), or the
# anchor it offers to merge rounds ("anchor_nan", ...), so tests can check that unmodified receivers
# reject it.
TEST_CORRUPT = os.environ.get("P2PDILOCO_TEST_CORRUPT", "")


def corrupt_for_test(delta: torch.Tensor, how: str) -> torch.Tensor:
    delta = delta.clone()
    if how == "nan":
        delta[::7] = float("nan")
    elif how == "inf":
        delta[0] = float("inf")
    elif how == "huge":
        delta *= 1e6
    else:
        raise ValueError(f"P2PDILOCO_TEST_CORRUPT must be nan, inf or huge, got {how!r}")
    return delta


@dataclass
class PendingRound:
    """The round in flight, and what applying (or discarding) it needs."""

    future: concurrent.futures.Future  # -> RoundOutcome
    snapshot: torch.Tensor  # the local weights the pseudo-gradient was taken from
    base: torch.Tensor      # what the local model has trained from since: the snapshot, or the eager preview
    tokens: int             # tokens behind the pseudo-gradient
    weight: float
    age: int                # outer steps behind the swarm when it started
    formed_at_step: Optional[int] = None  # our inner step when the group formed (set from the round's thread)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Peer:
    def __init__(self, cfg, *, quiet: bool = False, stop_event: Optional[threading.Event] = None,
                 model: Optional[torch.nn.Module] = None, inner_opt: Optional[torch.optim.Optimizer] = None,
                 eval_fn: Optional[Callable[[torch.nn.Module], float]] = None, handle_signals: bool = True):
        """model/inner_opt/eval_fn: a caller's own (the Python API); by default the config's model,
        AdamW, and the held-out loss of our corpus. handle_signals: SIGINT/SIGTERM stop the loop."""
        self.cfg = cfg
        self.stop_event = stop_event or threading.Event()
        self.state_lock = threading.Lock()  # guards anchor, momentum, outer_step (read by joiners' downloads)
        self.outer_step = 0
        self.inner_step = 0
        self.dht = self.averager = self.rounds = self.metrics = None
        self.pending = None
        self._progress_reading = None
        self.model, self.opt, self.eval_fn = model, inner_opt, eval_fn
        self.handle_signals = handle_signals
        # torchrun: DDP inside this peer, rank 0 talks to the swarm (a caller's own model brings its own)
        self.ranks = Ranks.from_env() if model is None else None
        self.leader = self.ranks is None or self.ranks.rank == 0
        self.quiet = quiet or not self.leader
        self._params_changed = False  # the leader rewrote the local weights: the other ranks must copy them
        self.maddrs: list[str] = []
        self.last_group_size = 0  # of the last applied round; with the counters below, for `status`/`monitor`
        self.rounds_applied = self.rounds_failed = 0
        self.last_eval_loss = None

    # ----------------------------------------------------------------------------- setup

    def _progress(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=sys.stderr, flush=True)

    def shared_state(self):
        """Called from hivemind's thread when a peer downloads our state."""
        with self.state_lock:
            return state.make_metadata(self.cfg, self.outer_step), [self.anchor.clone(), self.momentum.clone()]

    def _setup(self) -> None:
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        own_model = self.model is None
        if own_model:
            self.device = self.ranks.pick_device(cfg.device) if self.ranks else pick_device(cfg.device)
        else:
            self.device = next(self.model.parameters()).device
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        if self.ranks:
            self.ranks.init(self.device)
        self.resume = None
        if cfg.checkpoint_dir and self.leader:
            checkpoint.ensure_writable(cfg.checkpoint_dir)
            self.resume, path, problems = checkpoint.load_latest(cfg.checkpoint_dir, cfg)
            for problem in problems:
                self._progress(f"p2pdiloco: skipping a bad checkpoint: {problem}")
            if self.resume is not None:
                self._progress(f"p2pdiloco: resuming from {path} (outer step {self.resume['outer_step']})")
        self.eval_set = None
        if own_model:
            self.data = load_data(cfg, progress=self._progress)
            torch.manual_seed(cfg.seed)  # every peer starts from the same init
            self.model = build_model(cfg).to(self.device)
            self.eval_model = build_model(cfg).to(self.device).eval()
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.inner_lr, weight_decay=cfg.weight_decay,
                                         betas=(0.9, 0.95))
            self.eval_set = self.data.eval_batches(cfg.batch_size, cfg.eval_batches)
        else:
            self.eval_model = copy.deepcopy(self.model).eval() if self.eval_fn is not None else None
        self.numel = num_params(self.model)
        self.anchor = flat_params(self.model)
        self.momentum = torch.zeros_like(self.anchor)
        self.digest_idx = diloco.digest_indices(self.numel)
        self.autocast = self.device.type == "cuda"
        self.tokens = 0
        if self.resume is not None:
            self._restore(self.resume)
        if not self.leader:  # the other ranks of a torchrun peer train; only rank 0 joins the swarm
            self.metrics = Metrics(None, f"rank{self.ranks.rank}", quiet=True)
            return

        sinks.check_installed(tensorboard_dir=cfg.tensorboard_dir, wandb_project=cfg.wandb_project)
        quiet_lonely_rounds()
        self.dht = swarm.start_dht(cfg)
        self.peer_id = str(self.dht.peer_id)
        self.metrics = Metrics(cfg.log_dir or None, self.peer_id, quiet=self.quiet, tensorboard_dir=cfg.tensorboard_dir,
                               wandb_project=cfg.wandb_project, run_config=cfg.to_dict())
        if cfg.maddrs_file:
            swarm.write_maddrs(self.dht, cfg.maddrs_file)
        self.maddrs = swarm.visible_maddrs(self.dht)
        self._progress(f"p2pdiloco: peer {self.peer_id} up at {' '.join(self.maddrs)}")
        swarm.check_run_config(self.dht, cfg)
        self._announced = time.monotonic()
        slots = cfg.target_group_size if cfg.outer_apply == "per_contribution" else 1
        # merge_anchors: one buffer for [pseudo-gradient | anchor | momentum], the last two used by merge rounds
        self.merging = cfg.merge_anchors and slots == 1
        self.averager = DilocoAverager([torch.zeros(self.numel * (3 if self.merging else slots))], self.dht,
                                       cfg=cfg, state_fn=self.shared_state, slots=slots,
                                       merge_size=self.numel if self.merging else 0)
        self.rounds = RoundRunner(self.averager, self.dht, cfg)
        # again: hivemind's averager sets SIGINT to ignored when it starts
        if self.handle_signals:
            self._install_signal_handlers()

    def _data_order(self) -> torch.Generator:
        """Each peer (each rank of a torchrun peer) reads the corpus in its own order."""
        peer_id = self.ranks.broadcast_object(getattr(self, "peer_id", None)) if self.ranks else self.peer_id
        salt = peer_id if self.leader else f"{peer_id}/rank{self.ranks.rank}"
        return torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + zlib.crc32(salt.encode()))

    def _install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM ask the loop to stop cleanly; a second one interrupts at once."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            if self.stop_event.is_set():
                raise KeyboardInterrupt
            self.stop_event.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, handler)

    def _restore(self, payload: dict) -> None:
        """Resume from a checkpoint: outer state, local weights, inner optimizer and counters."""
        numel = self.numel
        for key in ("anchor", "momentum", "local"):
            t = payload.get(key)
            if not isinstance(t, torch.Tensor) or t.numel() != numel or not torch.isfinite(t).all():
                raise checkpoint.CheckpointError(f"checkpoint field {key} is missing, of the wrong size or not finite")
        self.anchor = payload["anchor"].float().clone()
        self.momentum = payload["momentum"].float().clone()
        self.outer_step = int(payload["outer_step"])
        self.inner_step = int(payload.get("inner_step", 0))
        load_flat_(self.model, payload["local"].float())
        try:
            self.opt.load_state_dict(payload["inner_opt"])
        except (KeyError, ValueError, RuntimeError) as e:
            logger.warning(f"inner optimizer state not restored ({e!r}); AdamW starts fresh")

    def _save_checkpoint(self) -> None:
        if not self.cfg.checkpoint_dir:
            return
        with self.state_lock:
            payload = {"format": 1, "run_id": self.cfg.run_id, "fingerprint": self.cfg.fingerprint(),
                       "outer_step": self.outer_step, "anchor": self.anchor.clone(),
                       "momentum": self.momentum.clone()}
        payload.update(inner_step=self.inner_step, local=flat_params(self.model),
                       inner_opt=self.opt.state_dict(), peer=self.peer_id)
        try:
            checkpoint.save_checkpoint(self.cfg.checkpoint_dir, payload, outer_step=self.outer_step)
        except OSError as e:  # disk full, dir removed...: keep training, the previous checkpoint stays
            self.metrics.log("checkpoint_failed", reason=str(e), outer_step=self.outer_step)
            self._progress(f"p2pdiloco: checkpoint write failed, previous one kept: {e}")

    def _join(self) -> None:
        """Load the swarm's outer state before training; the first peer starts the swarm.
        A peer resuming from a checkpoint takes the swarm's state only if it is further ahead."""
        if self.resume is not None:
            self.metrics.log("resume", outer_step=self.outer_step, inner_step=self.inner_step)
        if self.cfg.initial_peers:
            self._progress("p2pdiloco: downloading the swarm's state ...")
            timeout = self.cfg.state_timeout if self.resume is None else min(self.cfg.state_timeout, 10.0)
            loaded = state.download_state(self.averager, self.cfg, self.numel, timeout=timeout,
                                          progress=self._progress, stop_event=self.stop_event)
            if loaded is not None and self.resume is not None and loaded.outer_step <= self.outer_step:
                self._progress(f"p2pdiloco: our checkpoint (outer step {self.outer_step}) is as recent as the "
                               f"swarm's ({loaded.outer_step}); keeping it")
                loaded = None
            if loaded is not None:
                self._install(loaded, keep_local=False)
                self.metrics.log("join", loaded_outer_step=loaded.outer_step, download_s=loaded.download_s)
                self._progress(f"p2pdiloco: loaded outer step {loaded.outer_step} "
                               f"({self.numel * 8 / 1e6:.1f} MB in {loaded.download_s:.2f}s)")
            elif self.resume is None:
                self._progress("p2pdiloco: no peer shares state; starting from the run's initial weights")
        if not self.cfg.client_mode:
            self.averager.state_sharing_priority = float(self.outer_step)
            self.averager.allow_state_sharing = True
        if self.cfg.wait_for_peers > 1:
            self._wait_for_peers(self.cfg.wait_for_peers)

    def _wait_for_peers(self, count: int) -> None:
        """A swarm that starts together: no training until `count` peers of the run are ready to
        train (joined, state loaded), as their first progress records say."""
        self.last_loss = math.nan
        swarm.publish_progress(self.dht, self.cfg, self._progress_record(0.0))
        deadline = time.monotonic() + self.cfg.bootstrap_timeout
        started = 1
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            try:
                started = len(swarm.read_progress(self.dht, self.cfg, timeout=5.0))
            except Exception as e:  # a slow read: ask again until the deadline
                logger.debug(f"peer count read failed: {e!r}")
            if started >= count:
                return
            time.sleep(0.2)
        self._progress(f"p2pdiloco: {started} of {count} peers up after {self.cfg.bootstrap_timeout:.0f}s; "
                       "training anyway")

    def _install(self, loaded: state.OuterState, *, keep_local: bool, tokens_kept: int = 0) -> None:
        """Adopt a downloaded anchor; keep_local keeps the progress made since the last snapshot
        (tokens_kept tokens) and contributes it at once, to land in the same matchmaking window
        as the group it fell behind: waiting inner_steps would miss it and diverge again."""
        with self.state_lock:
            old_anchor = self.anchor
            self.anchor, self.momentum, self.outer_step = loaded.anchor, loaded.momentum, loaded.outer_step
        local = flat_params(self.model)
        base = self._snapshot if keep_local and self._snapshot is not None else old_anchor
        load_flat_(self.model, diloco.merge_local(self.anchor, local, base) if keep_local else self.anchor)
        self._params_changed = True
        self.tokens_since_anchor = tokens_kept if keep_local else 0
        self.steps_since_round = self.cfg.inner_steps if keep_local else 0
        if not self.cfg.client_mode:
            self.averager.state_sharing_priority = float(self.outer_step)

    # ------------------------------------------------------------------------------ loop

    def run(self) -> None:
        try:
            if self.handle_signals:
                self._install_signal_handlers()
            self._snapshot = None
            self._setup()
            if self.leader:
                self._join()
            self._train()
        finally:
            self.close()

    def start(self) -> None:
        """Set up and join the swarm without running our own loop (the Python API drives the
        steps through `after_step`)."""
        self._snapshot = None
        self._setup()
        self._join()
        self.begin_training()

    def begin_training(self) -> None:
        self.tokens_since_anchor = 0  # tokens behind the current pseudo-gradient
        self.steps_since_round = 0
        self.swarm_outer_step = self.outer_step
        self.swarm_size = 1
        self.due_steps = self.cfg.inner_steps  # inner steps per contribution (dynamic_inner_steps scales them)
        # eager outer updates need training while a round runs (not synchronous DiLoCo)
        self.eager = self.cfg.eager_outer and not self.cfg.sync_rounds and self.cfg.outer_apply == "group"
        self._progress_reading = None
        self.pending: Optional[PendingRound] = None
        self.t_start = self._last_log = self._last_step = time.monotonic()
        self.compute_s = 0.0  # inside forward, backward and the optimizer step: the utilization numerator
        self._loss_sum, self._loss_n, self._tokens_at_log = 0.0, 0, 0
        self.last_loss = math.nan

    def _train(self) -> None:
        cfg = self.cfg
        self.begin_training()
        tokens_per_step = cfg.batch_size * cfg.block_size * (self.ranks.world_size if self.ranks else 1)
        self.gen = self._data_order()
        model = self.model
        if self.ranks:  # gradients averaged across this peer's ranks every step; starts from rank 0's weights
            model = self.ranks.wrap(self.model)
            self.ranks.share_optimizer_state(self.opt, resumed=self.resume is not None)
        self.model.train()
        while True:
            stop = self._should_stop(self.t_start) if self.leader else False
            if self.ranks:
                stop = self._sync_ranks(stop)
            if stop:
                break
            # --- inner step ------------------------------------------------------------
            position = self.outer_step * cfg.inner_steps + self.steps_since_round
            lr = diloco.inner_lr_at(position, inner_lr=cfg.inner_lr, warmup_steps=cfg.warmup_steps,
                                    total_steps=cfg.total_steps, min_lr_ratio=cfg.min_lr_ratio)
            for group in self.opt.param_groups:
                group["lr"] = lr
            x, y = (t.to(self.device, non_blocking=True) for t in self.data.train_batch(cfg.batch_size, self.gen))
            t_compute = time.perf_counter()
            with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                loss = model(x, y)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # time the step, not its launch
            step_s = time.perf_counter() - t_compute
            self.compute_s += step_s
            if cfg.slowdown > 1:
                time.sleep(step_s * (cfg.slowdown - 1))
            if self.leader:
                self.after_step(loss.detach(), tokens_per_step)
            else:
                self.steps_since_round += 1
        self.finish_training()

    def after_step(self, loss: Optional[torch.Tensor], tokens: int) -> bool:
        """Count one inner step (its loss, its tokens); apply a round that came back; every
        inner_steps steps hand the pseudo-gradient to a background round. True when an outer step
        was applied (the local weights moved)."""
        cfg = self.cfg
        # a gap longer than a round could take: we were frozen (SIGSTOP, suspend, swap); the swarm
        # moved on, so look at where it is before contributing anything
        now = time.monotonic()
        if now - self._last_step > cfg.allreduce_timeout:
            self._check_swarm_outer_step()
        self._last_step = now
        self.inner_step += 1
        self.steps_since_round += 1
        self.tokens += tokens
        self.tokens_since_anchor += tokens
        if loss is not None:
            self._loss_sum = self._loss_sum + loss  # a tensor on the device: no sync per step
            self._loss_n += 1

        # --- outer step: a round came back -----------------------------------------
        applied = False
        if self.pending is not None and self.pending.future.done():
            pending, self.pending = self.pending, None
            applied = self._finish_round(pending)

        # --- every inner_steps steps: hand the pseudo-gradient to a background round ----
        if self.pending is None and self.steps_since_round >= self.due_steps:
            self.pending = self._start_round()
            if cfg.sync_rounds:
                applied = self._wait_round_sync(self.t_start) or applied

        # --- every log interval: status line, metrics, progress record -------------------
        now = time.monotonic()
        if now - self._last_log >= cfg.log_interval:
            self.last_loss = float(self._loss_sum) / self._loss_n if self._loss_n else math.nan
            tps = (self.tokens - self._tokens_at_log) / (now - self._last_log)
            self._log_inner(tps)
            self._loss_sum, self._loss_n, self._tokens_at_log, self._last_log = 0.0, 0, self.tokens, now
        return applied

    def finish_training(self) -> None:
        """After the loop: let the last round land (after a budget, not a signal), then the final
        evaluation and checkpoint."""
        wall_s = time.monotonic() - self.t_start
        if self.leader:
            if self.pending is not None and not self.stop_event.is_set():
                concurrent.futures.wait([self.pending.future], timeout=self._round_bound())
            if self.pending is not None and self.pending.future.done():
                pending, self.pending = self.pending, None
                self._finish_round(pending)
        extra = {}
        if self.ranks:  # one last copy of the leader's weights, then check that every rank holds them
            self._sync_ranks(True)
            extra = dict(ranks=self.ranks.world_size, rank_spread=self.ranks.spread(self.model))
        if not self.leader:
            return
        self.metrics.log("final", inner_step=self.inner_step, outer_step=self.outer_step, eval_loss=self._evaluate(),
                         tokens=self.tokens, compute_s=self.compute_s, wall_s=wall_s,
                         final_wait_s=time.monotonic() - self.t_start - wall_s, **extra)
        self._save_checkpoint()

    def _sync_ranks(self, stop: bool) -> bool:
        """Once per inner step on every rank: the leader's stop decision, schedule position and,
        when a round or a resync moved its weights, the weights themselves."""
        stop, changed, self.outer_step, self.steps_since_round = self.ranks.control(
            [int(stop), int(self._params_changed), self.outer_step, self.steps_since_round])
        if changed:
            self.ranks.broadcast_params(self.model)
            self._params_changed = False
        return bool(stop)

    def _round_bound(self) -> float:
        """The longest a round can take: matchmaking, all-reduce, verdicts."""
        cfg = self.cfg
        return cfg.matchmaking_time * 2 + cfg.request_timeout + cfg.allreduce_timeout + cfg.verdict_timeout + 5

    def _wait_round_sync(self, t_start: float) -> bool:
        """Synchronous DiLoCo: no training until a full round applies (retried while the group is short)."""
        while self.pending is not None and not self.stop_event.is_set() and not self._out_of_time(t_start):
            concurrent.futures.wait([self.pending.future], timeout=0.5)
            if self.pending.future.done():
                pending, self.pending = self.pending, None
                if self._finish_round(pending):
                    return True
                self.pending = self._start_round()  # same pseudo-gradient: we have not trained since
        return False

    def _should_stop(self, t_start: float) -> bool:
        return (self.stop_event.is_set() or self._out_of_time(t_start)
                or (self.cfg.max_inner_steps > 0 and self.inner_step >= self.cfg.max_inner_steps))

    def _out_of_time(self, t_start: float) -> bool:
        return self.cfg.max_time > 0 and time.monotonic() - t_start >= self.cfg.max_time

    def _log_inner(self, tokens_per_s: float) -> None:
        self.metrics.log("inner", inner_step=self.inner_step, outer_step=self.outer_step, loss=self.last_loss,
                         tokens=self.tokens, tokens_per_s=tokens_per_s, compute_s=self.compute_s)
        self.metrics.status(f"[{self.peer_id[-6:]}] step {self.inner_step:6d}  outer {self.outer_step:4d}  "
                            f"loss {self.last_loss:6.3f}  {tokens_per_s:8.0f} tok/s")
        if time.monotonic() - self._announced > 60:
            swarm.announce_config(self.dht, self.cfg)
            self._announced = time.monotonic()
        swarm.publish_progress(self.dht, self.cfg, self._progress_record(tokens_per_s))
        self._refresh_swarm_outer_step()

    def _progress_record(self, tokens_per_s: float) -> dict:
        """What `status` and `monitor` show of this peer (and what the staleness check reads)."""
        return {"outer_step": self.outer_step, "inner_step": self.inner_step, "loss": self.last_loss,
                "tokens_per_s": tokens_per_s, "tokens": self.tokens, "device": self.device_name,
                "maddrs": self.maddrs[:4], "group_size": self.last_group_size, "rounds_applied": self.rounds_applied,
                "rounds_failed": self.rounds_failed, "eval_loss": self.last_eval_loss, "time": time.time()}

    def _check_swarm_outer_step(self) -> None:
        """Blocking read of the swarm's outer step (after a freeze, before the next contribution)."""
        try:
            records = swarm.read_progress(self.dht, self.cfg, timeout=10.0)
        except Exception as e:  # the DHT may be slow right after a freeze; the digest check still guards
            logger.warning(f"could not read the swarm's progress: {e!r}")
            return
        self._note_progress(records)

    def _note_progress(self, records: dict) -> None:
        self.swarm_outer_step = max([self.outer_step, *(r.get("outer_step", 0) for r in records.values())])
        self.swarm_size = len(set(records) | {self.peer_id})  # live peers: records expire
        if self.cfg.dynamic_inner_steps and not self.cfg.sync_rounds:
            speeds = {peer: r.get("tokens_per_s") for peer, r in records.items()}
            self.due_steps = diloco.dynamic_inner_steps(self.cfg.inner_steps, speeds.get(self.peer_id),
                                                        list(speeds.values()))

    def _refresh_swarm_outer_step(self) -> None:
        """The highest outer step in the peers' progress records (read in the background)."""
        if self._progress_reading is not None and self._progress_reading.done():
            try:
                self._note_progress(swarm.parse_progress(self._progress_reading.result()))
            except Exception as e:  # a failed read only delays the staleness check
                logger.debug(f"progress read failed: {e!r}")
            self._progress_reading = None
        if self._progress_reading is None:
            self._progress_reading = self.dht.get(f"{self.cfg.dht_prefix}_progress", latest=True,
                                                  return_future=True)

    # ------------------------------------------------------------------------- rounds

    def _start_round(self):
        cfg = self.cfg
        age = max(0, self.swarm_outer_step - self.outer_step)
        too_stale = age > cfg.max_staleness
        if too_stale and not self.merging:
            self._resync(f"{age} outer steps behind the swarm", keep_local=False)
            return None
        snapshot = flat_params(self.model)
        with self.state_lock:
            delta = diloco.pseudo_grad(self.anchor, snapshot)
            digest = diloco.anchor_digest(self.anchor, self.digest_idx)
            anchor, momentum = (self.anchor.clone(), self.momentum.clone()) if self.merging else (None, None)
        if too_stale:  # too old to help: contribute nothing, take the group's anchor in the merge round
            delta.zero_()
        if TEST_CORRUPT.startswith("anchor_") and anchor is not None:  # its digest differs: every round merges
            anchor = corrupt_for_test(anchor, TEST_CORRUPT.removeprefix("anchor_"))
            digest = [v + 1.0 for v in digest]
        elif TEST_CORRUPT:
            delta = corrupt_for_test(delta, TEST_CORRUPT)
        # per_contribution: equal weights, so slot j of the average is member j's pseudo-gradient / group size
        weight = 1.0 if cfg.outer_apply == "per_contribution" else contribution_weight(self.tokens_since_anchor, age)
        gather = {"peer": self.peer_id, "outer_step": self.outer_step, "tokens": self.tokens_since_anchor,
                  "digest": digest, "swarm": self.swarm_size}
        if cfg.full_groups:  # everyone live is expected: the group forms once they are all in
            live = min(cfg.target_group_size, self.swarm_size)
            self.averager.set_target_group_size(live if live >= max(2, cfg.min_group_size) else cfg.target_group_size)
        base = snapshot
        if self.eager:  # train the round in flight from where the anchor will about be (arXiv 2502.12996)
            with self.state_lock:
                base = diloco.preview_outer_step(self.anchor, self.momentum, delta, outer_lr=cfg.outer_lr,
                                                 outer_momentum=cfg.outer_momentum)
            load_flat_(self.model, base)
            self._params_changed = True
        self.steps_since_round = 0
        outer_step = self.outer_step

        def formed() -> None:  # in the round's thread
            pending.formed_at_step = self.inner_step
            self.metrics.log("allreduce_started", outer_step=outer_step)

        pending = PendingRound(None, snapshot, base, self.tokens_since_anchor, weight, age)
        pending.future = self.rounds.start(delta, weight=weight, gather=gather, anchor=anchor, momentum=momentum,
                                           on_allreduce=formed)
        return pending

    def _finish_round(self, pending: PendingRound) -> bool:
        """Apply the round's average as one outer step (True), or discard it (False)."""
        snapshot, base, tokens, weight, age = pending.snapshot, pending.base, pending.tokens, pending.weight, pending.age
        outcome: RoundOutcome = pending.future.result()
        if outcome.report is not None:
            for peer, why in outcome.report.rejected.items():
                self.metrics.log("bad_contribution", sender=peer, reason=why, outer_step=self.outer_step)
        if not outcome.ok and base is not snapshot:  # eager: back onto our own anchor, our work kept
            load_flat_(self.model, diloco.merge_local(snapshot, flat_params(self.model), base))
            self._params_changed = True
        if not outcome.ok:
            self.metrics.log("round_failed", reason=outcome.reason, outer_step=self.outer_step,
                             round_s=outcome.round_s)
            self.rounds_failed += 1
            logger.info(f"round discarded: {outcome.reason}")
            return False
        members = list(outcome.members.values())
        reference = max(members, key=lambda m: (m["outer_step"], m["peer"]))
        mine = outcome.members[self.peer_id]
        spread = max(diloco.digest_spread(m["digest"], reference["digest"]) for m in members)
        merged = outcome.anchor is not None
        if not merged and diloco.digest_spread(mine["digest"], reference["digest"]) > self.cfg.anchor_tolerance:
            self._snapshot = snapshot
            # the reference members apply this round: wait until one of them offers the result
            self._resync(f"anchor differs from the group's (spread {spread:.2e})", keep_local=True,
                         min_outer_step=reference["outer_step"] + 1, tokens_kept=self.tokens_since_anchor - tokens)
            return False
        diverged = sum(diloco.digest_spread(m["digest"], reference["digest"]) > self.cfg.anchor_tolerance
                       for m in members)
        # every member derives the same share from the same announcements, so anchors stay equal
        share = diloco.group_share([m.get("swarm", 1) for m in members]) if self.cfg.group_share else 1.0
        with self.state_lock:
            if merged:  # everyone's anchor and momentum, merged in the round: nobody's progress is lost
                self.anchor, self.momentum = outcome.anchor, outcome.momentum
            if self.cfg.outer_apply == "per_contribution":  # the negative control: momentum per contribution
                for contribution in outcome.average.view(-1, self.numel)[:len(members)]:
                    diloco.outer_step_(self.anchor, self.momentum, contribution * len(members),
                                       outer_lr=self.cfg.outer_lr, outer_momentum=self.cfg.outer_momentum)
            else:
                diloco.outer_step_(self.anchor, self.momentum, outcome.average * share, outer_lr=self.cfg.outer_lr,
                                   outer_momentum=self.cfg.outer_momentum)
            self.outer_step = max(m["outer_step"] for m in members) + 1
        local = flat_params(self.model)
        load_flat_(self.model, diloco.merge_local(self.anchor, local, base))
        self._params_changed = True
        self.tokens_since_anchor -= tokens
        if self.cfg.full_groups and pending.formed_at_step is not None:
            # count the next inner_steps from the moment the group formed, the same for every member: the
            # group's next round then finds them all ready at once instead of spread over the window
            self.steps_since_round = self.inner_step - pending.formed_at_step
        self.swarm_outer_step = max(self.swarm_outer_step, self.outer_step)
        if not self.cfg.client_mode:
            self.averager.state_sharing_priority = float(self.outer_step)
        report = outcome.report
        self.last_group_size = len(members)
        self.rounds_applied += 1
        if self.outer_step % self.cfg.eval_every == 0:
            self.last_eval_loss = eval_loss = self._evaluate()
        else:
            eval_loss = None
        self.metrics.log("outer", outer_step=self.outer_step, group_size=len(members), share=share, weight=weight,
                         tokens=tokens, staleness=age, round_s=outcome.round_s, bytes_sent=report.bytes_sent,
                         bytes_recv=report.bytes_recv, anchor_spread=spread, eval_loss=eval_loss,
                         diverged_members=diverged, merged=merged, swarm_size=self.swarm_size,
                         digest=diloco.anchor_digest(self.anchor, self.digest_idx))
        if self.outer_step % self.cfg.checkpoint_every == 0:
            self._save_checkpoint()
        return True

    def _resync(self, reason: str, *, keep_local: bool, min_outer_step: int = 0, tokens_kept: int = 0) -> None:
        self._progress(f"p2pdiloco: resyncing state ({reason}) ...")
        loaded = state.download_state(self.averager, self.cfg, self.numel, timeout=self.cfg.state_timeout,
                                      min_outer_step=min_outer_step, stop_event=self.stop_event)
        if loaded is None:
            self.metrics.log("round_failed", reason=f"resync failed: {reason}", outer_step=self.outer_step)
            return
        self._install(loaded, keep_local=keep_local, tokens_kept=tokens_kept)
        self.metrics.log("resync", reason=reason, loaded_outer_step=loaded.outer_step, download_s=loaded.download_s)

    @torch.no_grad()
    def _evaluate(self) -> Optional[float]:
        """Loss of the anchor (the swarm's model) on the held-out batches, or the caller's eval_fn
        on the anchor; None when there is nothing to evaluate with."""
        if self.eval_model is None:
            return None
        with self.state_lock:
            load_flat_(self.eval_model, self.anchor)
        if self.eval_fn is not None:
            return float(self.eval_fn(self.eval_model))
        losses = []
        for x, y in self.eval_set:
            with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                losses.append(float(self.eval_model(x.to(self.device), y.to(self.device))))
        return sum(losses) / len(losses)

    # --------------------------------------------------------------------------- stop

    def close(self) -> None:
        """Stop the averager and the DHT (and its p2pd); safe to call more than once."""
        if self.averager is not None:
            try:
                self.averager.shutdown()  # cancels a round in flight
            except Exception as e:  # keep stopping the DHT whatever happened here
                logger.warning(f"averager shutdown failed: {e!r}")
            self.averager = None
        # let DHT calls in flight (a round's verdict, a progress read) finish before the DHT goes:
        # hivemind's DHT can hang on shutdown when a request arrives while it stops
        for future in (self.pending.future if self.pending else None, self._progress_reading):
            if future is not None:
                try:
                    future.result(timeout=2.0)
                except Exception as e:  # a failed or cancelled request is fine at this point
                    logger.debug(f"request in flight at shutdown: {e!r}")
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        if self.metrics is not None:
            self.metrics.close()
        if self.ranks is not None:
            self.ranks.close()
