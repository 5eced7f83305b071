"""One peer of the swarm: the inner loop, read top to bottom, and the outer step when a round returns.

    >>> peer = Peer(cfg)
    >>> peer.run()             # until SIGINT/SIGTERM, max_time or max_inner_steps; stops its children

The loop never waits for the network: every `inner_steps` steps it hands the pseudo-gradient to a
background round (RoundRunner) and keeps training; when the round's future is done it applies one
outer step (or discards the round) and goes on. How a round starts and lands is in outer.py
(Rounds, the round driver the peer owns, with the outer state); the math is in diloco.py.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import logging
import math
import signal
import sys
import threading
import time
import zlib
from typing import Callable, Optional

import torch

from p2pdiloco import bootstrap, checkpoint, diloco, reachability, sinks, state, swarm
from p2pdiloco.averaging import DilocoAverager, RoundRunner, quiet_expected_events
from p2pdiloco.boundary import Boundary
from p2pdiloco.data import DataError, load_data
from p2pdiloco.data.claims import ShardClaims, Stopped
from p2pdiloco.data.feed import DataFeed
from p2pdiloco.data.fetch import ShardCache, ShardSource
from p2pdiloco.device import pick_device
from p2pdiloco.evaluator import Evaluator
from p2pdiloco.metrics import Metrics
from p2pdiloco.model import build_model, flat_params, load_flat_, num_params
from p2pdiloco.outer import OuterState, Rounds
from p2pdiloco.records import SwarmRecords
from p2pdiloco.steptimer import StepTimer
from p2pdiloco.ranks import Ranks
from p2pdiloco.suspects import Suspects

logger = logging.getLogger(__name__)


def fixed_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """glibc raises its mmap threshold each time a large block is freed (up to 32 MB), after which
    blocks of a layer's size come from the heap and are not given back: a peer's memory crept up by
    GBs. A fixed threshold keeps every block over 1 MB in its own mapping, returned when freed.
    Inherited by the DHT and averager processes (set before they fork); a no-op off glibc."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError) as e:
        logger.debug(f"mallopt unavailable: {e!r}")


def _cpu_copy(obj):
    """A copy of a state dict's tensors on the CPU (an optimizer's state changes in place every step)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


def eval_module(cfg, model: torch.nn.Module) -> torch.nn.Module:
    """The module the evaluator's thread runs beside the training: its parameters come at each call
    (views of the anchor), so built on the meta device it holds no memory of its own and shares no
    state with the module being trained; a model that cannot be built there is copied."""
    try:
        with torch.device("meta"):
            module = build_model(cfg, pretrained=False)
    except (RuntimeError, NotImplementedError, ValueError) as e:
        logger.debug(f"meta-device build failed ({e!r}); evaluating a copy of the model")
        module = copy.deepcopy(model)
    return module.eval()


def model_size(cfg) -> int:
    """The number of parameters of the config's model, built on the meta device (no memory); a
    model whose init needs real values (some Hugging Face ones call .item()) is built on the CPU."""
    try:
        with torch.device("meta"):
            return num_params(build_model(cfg, pretrained=False))
    except (RuntimeError, NotImplementedError, ValueError) as e:
        logger.debug(f"meta-device build failed ({e!r}); building on the CPU for the size")
        return num_params(build_model(cfg, pretrained=False))


class Peer:
    def __init__(self, cfg, *, quiet: bool = False, stop_event: Optional[threading.Event] = None,
                 model: Optional[torch.nn.Module] = None, inner_opt: Optional[torch.optim.Optimizer] = None,
                 eval_fn: Optional[Callable[[torch.nn.Module], float]] = None, handle_signals: bool = True):
        """model/inner_opt/eval_fn: a caller's own (the Python API); by default the config's model,
        AdamW, and the held-out loss of our corpus. handle_signals: SIGINT/SIGTERM stop the loop."""
        self.cfg = cfg
        self.stop_event = stop_event or threading.Event()
        self.inner_step = 0
        self.dht = self.averager = self.metrics = None
        self.runner: Optional[RoundRunner] = None  # runs one averaging round in a thread of its own
        self.claims = None  # data/claims.py, for prepared tokens
        self.shard_source = None  # data/fetch.py: the shards we hold, and the others from peers
        # parts the peer owns, each on its own thread where it blocks (started once training begins)
        self.outer: Optional[OuterState] = None  # anchor, outer momentum, outer step (outer.py)
        self.rounds: Optional[Rounds] = None  # the round driver (outer.py); rank 0 of a torchrun peer only
        self.boundary: Optional[Boundary] = None  # the round boundary's buffers (boundary.py)
        self.evaluator: Optional[Evaluator] = None  # the anchor's evaluation
        self.records: Optional[SwarmRecords] = None  # our DHT records and the others'
        self.feed: Optional[DataFeed] = None  # batches, and the shard claims behind them
        self._writer: Optional[threading.Thread] = None  # the checkpoint being written
        self.data = None
        self.model, self.opt, self.eval_fn = model, inner_opt, eval_fn
        self.handle_signals = handle_signals
        # torchrun: DDP inside this peer, rank 0 talks to the swarm (a caller's own model brings its own)
        self.ranks = Ranks.from_env() if model is None else None
        self.leader = self.ranks is None or self.ranks.rank == 0
        self.quiet = quiet or not self.leader
        self.position = 0  # the other ranks of a torchrun peer: the leader's position in the run, every step
        self.maddrs: list[str] = []
        self.peer_id: Optional[str] = None  # the DHT's, once the network is up (rank 0 of a torchrun peer)
        self.last_eval_loss = None

    # ----------------------------------------------------------------------------- setup

    def _progress(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=sys.stderr, flush=True)

    @property
    def outer_step(self) -> int:
        return self.outer.step if self.outer is not None else 0

    def _setup(self) -> None:
        """The network first, then the model: hivemind forks the DHT and averager processes, and a
        child forked after the model, its optimizer and the anchor exist keeps a private copy of
        every page the trainer writes afterwards (measured at 85M: 1.6 and 2.3 GB of RSS)."""
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        fixed_mmap_threshold()
        own_model = self.model is None
        if own_model:
            self.device = self.ranks.pick_device(cfg.device) if self.ranks else pick_device(cfg.device)
            self.numel = model_size(cfg)
        else:
            self.device = next(self.model.parameters()).device
            self.numel = num_params(self.model)
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        if self.ranks:
            self.ranks.init(self.device)
        if cfg.checkpoint_dir and self.leader:
            checkpoint.ensure_writable(cfg.checkpoint_dir)
        if cfg.init_from_digest and self.leader:
            self._progress(f"p2pdiloco: init_from {cfg.init_from}: weights sha256 {cfg.init_from_digest} (a peer "
                           f"without the weights joins with --init-from-sha256 {cfg.init_from_digest})")
        if own_model:  # a bad data path is a one-line error before anything starts; read-only pages
            self.data = load_data(cfg, progress=self._progress)  # stay shared with the forked children
        # anchor | momentum in shared memory, before the averager forks: it serves them to joiners
        self.outer = OuterState(state.SharedState(self.numel, shared=self.leader),
                                average_weight=cfg.anchor_average if self.leader else 0.0, device=self.device)
        if self.leader:
            self._start_network()
        self._claim_data()
        self._build_training(own_model)
        if not self.leader:  # the other ranks of a torchrun peer train; only rank 0 joins the swarm
            self.metrics = Metrics(None, f"rank{self.ranks.rank}", quiet=True)

    def _start_network(self) -> None:
        """DHT (and p2pd), reachability, metrics and the averager with its shared buffer."""
        cfg = self.cfg
        sinks.check_installed(tensorboard_dir=cfg.tensorboard_dir, wandb_project=cfg.wandb_project)
        quiet_expected_events()
        self.dht = bootstrap.start_dht(cfg, stop_event=self.stop_event)
        self.reach = self._check_reachability()
        self.peer_id = str(self.dht.peer_id)
        self.metrics = Metrics(cfg.log_dir or None, self.peer_id, quiet=self.quiet, tensorboard_dir=cfg.tensorboard_dir,
                               wandb_project=cfg.wandb_project, run_config=cfg.to_dict())
        if cfg.maddrs_file:
            swarm.write_maddrs(self.dht, cfg.maddrs_file)
        self.maddrs = swarm.visible_maddrs(self.dht)
        self._progress(f"p2pdiloco: peer {self.peer_id} up at {' '.join(self.maddrs)}")
        self._progress(self.reach.explain(cfg, forced=cfg.client_mode or cfg.reachability == "client"))
        self.metrics.log("reachability", mode=self.reach.mode, reached=self.reach.reached, tried=self.reach.tried,
                         answers=self.reach.answers, errors=self.reach.errors, check_s=self.reach.check_s)
        swarm.check_run_config(self.dht, cfg)
        slots = cfg.target_group_size if cfg.outer_apply == "per_contribution" else 1
        # merge_anchors: one buffer for [pseudo-gradient | anchor | momentum], the last two used by merge rounds
        self.merging = cfg.merge_anchors and slots == 1
        # prepared tokens read in claimed order: we serve the shards we hold and fetch the others
        data = self.data
        sharing = getattr(data, "fetch", False) and cfg.data_order == "claims"
        self.averager = DilocoAverager([torch.empty(self.numel * (3 if self.merging else slots))], self.dht,
                                       cfg=cfg, shared=self.outer.shared, slots=slots,
                                       merge_size=self.numel if self.merging else 0, client_mode=self.reach.client,
                                       shards={name: (str(path), path.stat().st_size) for name, path
                                               in data.paths.items()} if sharing else None,
                                       shard_cache=ShardCache(cfg.shard_cache_dir, int(cfg.shard_cache_gb * 2**30))
                                       if sharing else None)
        self.averager.release_staging()  # merge segments and download staging: in memory only while used
        self.runner = RoundRunner(self.averager, self.dht, cfg)
        self.suspects = Suspects(ban_time=cfg.ban_time, peer_id=self.peer_id)
        # again: hivemind's averager sets SIGINT to ignored when it starts
        if self.handle_signals:
            self._install_signal_handlers()

    def _claim_data(self) -> None:
        """Prepared tokens: each peer reads shards it claimed through the DHT, shards_per_peer at once
        (data/claims.py). Text data, data_order = random and the other ranks of a torchrun peer
        read random windows in their own order."""
        self.claims = None
        if (not self.leader or self.cfg.data_order != "claims"
                or getattr(self.data, "claimable", None) is None):
            return
        try:
            live = swarm.read_status(self.dht, self.cfg, timeout=self.cfg.request_timeout)
        except TimeoutError:
            live = {}
        epochs = [r["data"]["epoch"] for r in live.values() if isinstance(r.get("data"), dict)
                  and isinstance(r["data"].get("epoch"), int)]
        self.shard_source = ShardSource(self.data, self.averager, self.dht, self.cfg, self.peer_id,
                                        stop_event=self.stop_event, report=lambda **r: self.metrics.log("fetch", **r),
                                        say=self._progress)
        self.shard_source.announce()
        self._fetch_held_out()
        self.claims = ShardClaims(self.dht, self.cfg, shards=self.data.claimable(), peer_id=self.peer_id,
                                  on_range=lambda **r: self.metrics.log("data", **r),
                                  start_epoch=min(epochs) if epochs else 0, width=self.cfg.shards_per_peer,
                                  source=self.shard_source, stop_event=self.stop_event)
        self.data.order = self.claims

    def _fetch_held_out(self) -> None:
        """The held-out shards we lack, from the peers that hold them (every peer evaluates on all),
        waiting up to state_timeout for a holder to announce them."""
        deadline = time.monotonic() + self.cfg.state_timeout
        for shard in self.data.missing("val"):
            self._progress(f"p2pdiloco: fetching held-out shard {shard.file} from peers")
            while not self.shard_source.get(shard, timeout=max(1.0, deadline - time.monotonic())):
                if self.stop_event.wait(1.0):
                    raise KeyboardInterrupt  # a stop before training: the CLI exits cleanly, as in bootstrap
                if time.monotonic() >= deadline:
                    raise DataError(f"the held-out shard {shard.file} is neither in {self.cfg.data} nor at a live "
                                    f"peer (waited {self.cfg.state_timeout:.0f}s)")

    def _build_training(self, own_model: bool) -> None:
        """Checkpoint, data, model, inner optimizer, anchor and outer momentum."""
        cfg = self.cfg
        self.resume = None
        if cfg.checkpoint_dir and self.leader:
            self.resume, path, problems = checkpoint.load_latest(cfg.checkpoint_dir, cfg)
            for problem in problems:
                self._progress(f"p2pdiloco: skipping a bad checkpoint: {problem}")
            if self.resume is not None:
                self._progress(f"p2pdiloco: resuming from {path} (outer step {self.resume['outer_step']})")
        self.eval_set = self.eval_model = None
        if own_model:
            torch.manual_seed(cfg.seed)  # every peer starts from the same init
            self.model = build_model(cfg).to(self.device)
            # fused AdamW on CUDA: one kernel for all parameters instead of a few per parameter
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.inner_lr, weight_decay=cfg.weight_decay,
                                         betas=(0.9, 0.95), fused=self.device.type == "cuda")
            self.eval_set = self.data.eval_batches(cfg.batch_size, cfg.eval_batches)
            self.eval_model = eval_module(cfg, self.model)
        elif self.eval_fn is not None:  # a caller's eval_fn takes a module: it gets a copy holding the anchor
            self.eval_model = copy.deepcopy(self.model).eval()
        self.autocast = self.device.type == "cuda"
        self.tokens = 0
        with self.outer.updating():
            self.outer.anchor.copy_(flat_params(self.model))
        if self.resume is not None:
            self._restore(self.resume)
        if self.leader:
            self.boundary = Boundary(list(self.model.parameters()), numel=self.numel)
        # the inner steps' module: compiled on CUDA by default (its parameters are the model's own)
        compile_on = cfg.compile == "on" or (cfg.compile == "auto" and self.device.type == "cuda")
        self.step_model = torch.compile(self.model) if own_model and compile_on else self.model

    def _check_reachability(self) -> reachability.Reachability:
        """Ask other peers to dial us back (reachability = auto); a peer nobody can dial averages as a
        client, and its DHT restarts as a client so that nobody's lookups wait on it."""
        cfg = self.cfg
        if cfg.client_mode or cfg.reachability == "client":
            reach = reachability.Reachability(mode="client")
        elif all(swarm.is_loopback(m) for m in cfg.host_maddrs):
            reach = reachability.Reachability(mode="local")
        elif cfg.reachability == "public" or not cfg.initial_peers:
            reach = reachability.Reachability(mode="unknown" if cfg.reachability == "auto" else "direct")
        else:
            try:
                progress = swarm.read_progress(self.dht, cfg, timeout=5.0)
            except Exception as e:  # a slow read: the initial peers may still answer
                logger.debug(f"progress read failed: {e!r}")
                progress = {}
            maddrs = [str(a) for a in self.dht.get_visible_maddrs(latest=True)]
            reach = reachability.check(self.dht, cfg, maddrs, reachability.helpers_for(self.dht, cfg, progress))
        if reach.client and cfg.reachability == "auto" and not cfg.client_mode:
            # the initial peers may be gone by now: bootstrap through every live peer we know of
            learned = swarm.learned_peers(self.dht, cfg)
            old, self.dht = self.dht, None  # close() must not stop it twice if the restart fails
            old.shutdown()
            self.dht = bootstrap.start_dht(dataclasses.replace(cfg, client_mode=True,
                                                           initial_peers=[*cfg.initial_peers, *learned]),
                                       stop_event=self.stop_event)
        if not reach.client:
            reachability.serve(self.dht)
        return reach

    def _data_order(self) -> torch.Generator:
        """Each peer (each rank of a torchrun peer) reads the corpus in its own order."""
        peer_id = self.ranks.broadcast_object(self.peer_id) if self.ranks else self.peer_id
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
            if not isinstance(t, torch.Tensor) or t.numel() != numel or not state.all_finite(t):
                raise checkpoint.CheckpointError(f"checkpoint field {key} is missing, of the wrong size or not finite")
        self.outer.load(payload["anchor"], payload["momentum"], int(payload["outer_step"]))
        average = payload.get("average")  # absent from older checkpoints: the average starts from the anchor
        if self.outer.average is not None and isinstance(average, torch.Tensor) and average.numel() == numel \
                and state.all_finite(average):
            with self.outer.lock:
                self.outer.average.copy_(average.reshape(-1))
                self.outer.averaged = max(1, int(payload.get("averaged", 1)))
        self.inner_step = int(payload.get("inner_step", 0))
        if self.claims is not None and isinstance(payload.get("data_order"), dict):
            self.claims.restore(payload["data_order"])
        load_flat_(self.model, payload["local"].float())
        try:
            self.opt.load_state_dict(payload["inner_opt"])
        except (KeyError, ValueError, RuntimeError) as e:
            logger.warning(f"inner optimizer state not restored ({e!r}); AdamW starts fresh")

    def _save_checkpoint(self, *, wait: bool = False) -> None:
        """A checkpoint from a snapshot: the local weights and the inner optimizer's state are copied here
        (a step boundary), the anchor and momentum by the writer's thread, which writes the file (atomically:
        a kill mid-write leaves the previous one). A write still running makes this one skip, unless wait
        (the last one, at the end). The writer drops a snapshot whose anchor moved meanwhile (an outer step
        landed in the round's thread): local weights and anchor must belong together."""
        if not self.cfg.checkpoint_dir:
            return
        if self._writer is not None and self._writer.is_alive():
            if not wait:
                return
            self._writer.join()
        outer = self.outer
        outer_step = outer.step
        payload = {"format": 1, "run_id": self.cfg.run_id, "fingerprint": self.cfg.fingerprint(),
                   "outer_step": outer_step, "inner_step": self.inner_step, "local": flat_params(self.model).cpu(),
                   "inner_opt": _cpu_copy(self.opt.state_dict()), "peer": self.peer_id,
                   "data_order": self.claims.state() if self.claims is not None else None}

        def write() -> None:
            with outer.lock:
                if outer.step != outer_step:
                    logger.info(f"checkpoint of outer step {outer_step} skipped: the anchor moved meanwhile")
                    return
                payload.update(anchor=outer.anchor.clone(), momentum=outer.momentum.clone())
                if outer.average is not None:  # the model a user keeps (export, sample)
                    payload.update(average=outer.average.to("cpu", copy=True), averaged=outer.averaged)
            try:
                checkpoint.save_checkpoint(self.cfg.checkpoint_dir, payload, outer_step=outer_step)
            except OSError as e:  # disk full, dir removed...: keep training, the previous checkpoint stays
                self.metrics.log("checkpoint_failed", reason=str(e), outer_step=outer_step)
                self._progress(f"p2pdiloco: checkpoint write failed, previous one kept: {e}")

        self._writer = threading.Thread(target=write, name="checkpoint-writer", daemon=True)
        self._writer.start()
        if wait:
            self._writer.join()

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
                self.outer.load(loaded.anchor, loaded.momentum, loaded.outer_step)
                self.averager.release_staging()  # `loaded` was a view of its staging area
                load_flat_(self.model, self.outer.anchor)
                self.metrics.log("join", loaded_outer_step=loaded.outer_step, download_s=loaded.download_s,
                                 sources=len(loaded.sources))
                self._progress(f"p2pdiloco: loaded outer step {loaded.outer_step} ({self.numel * 8 / 1e6:.1f} MB "
                               f"in {loaded.download_s:.2f}s from {len(loaded.sources)} peer(s))")
            elif self.resume is None:
                self._progress("p2pdiloco: no peer shares state; starting from the run's initial weights")
        if not self.reach.client:  # a client cannot be dialed: a joiner must never pick it as a source
            self.averager.state_sharing_priority = float(self.outer_step)
            self.averager.allow_state_sharing = True
        if self.cfg.wait_for_peers > 1:
            self._wait_for_peers(self.cfg.wait_for_peers)

    def _wait_for_peers(self, count: int) -> None:
        """A swarm that starts together: no training until `count` peers of the run are ready to
        train (joined, state loaded), as their first progress records say."""
        self.last_loss = math.nan
        record = self._progress_record(0.0)
        swarm.publish_progress(self.dht, self.cfg, record)
        swarm.publish_status(self.dht, self.cfg, record, every=swarm.STATUS_EVERY)
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

    # ------------------------------------------------------------------------------ loop

    def run(self) -> None:
        try:
            if self.handle_signals:
                self._install_signal_handlers()
            self._setup()
            if self.leader:
                self._join()
            self._train()
        finally:
            self.close()

    def start(self) -> None:
        """Set up and join the swarm without running our own loop (the Python API drives the
        steps through `after_step`)."""
        self._setup()
        self._join()
        self.begin_training()

    def begin_training(self) -> None:
        """The loop's counters and, on the peer that talks to the swarm, the parts that run beside it:
        the evaluator, the records thread and the round driver."""
        cfg = self.cfg
        self.t_start = self._last_log = time.monotonic()
        self.timer = StepTimer(self.device)  # inside forward, backward and optimizer step: the utilization numerator
        self.data_s = 0.0  # waiting for the next batch
        self.eval_s = 0.0  # evaluating the anchor in this thread (the final evaluation)
        self._loss_sum, self._loss_n, self._tokens_at_log = 0.0, 0, 0
        self.last_loss = math.nan
        if not self.leader:
            return
        self.evaluator = Evaluator(self._evaluate_anchor, budget=cfg.eval_budget, on_result=self._evaluated)
        self.records = SwarmRecords(self.dht, cfg, claims=self.claims, shard_source=self.shard_source,
                                    swarm_size=lambda: self.rounds.swarm_size if self.rounds else 1)
        self.rounds = Rounds(cfg, outer=self.outer, model=self.model, boundary=self.boundary, numel=self.numel,
                             metrics=self.metrics, suspects=self.suspects, averager=self.averager, runner=self.runner,
                             dht=self.dht, records=self.records, evaluator=self.evaluator, peer_id=self.peer_id,
                             merging=self.merging, stop_event=self.stop_event, save_checkpoint=self._save_checkpoint,
                             say=self._progress, out_of_time=lambda: self._out_of_time(self.t_start))
        self.rounds.begin(self.inner_step)

    @property
    def outer_s(self) -> float:
        """The training thread's seconds at rounds' boundaries (outer.py)."""
        return self.rounds.outer_s if self.rounds is not None else 0.0

    @property
    def compute_s(self) -> float:
        return self.timer.total_s

    def _train(self) -> None:
        cfg = self.cfg
        self.begin_training()
        tokens_per_step = cfg.batch_size * cfg.block_size * (self.ranks.world_size if self.ranks else 1)
        gen = self._data_order()
        self.feed = DataFeed(lambda: self.data.train_batch(cfg.batch_size, gen), depth=2,
                             pin=self.device.type == "cuda", stop_event=self.stop_event)
        model = self.step_model
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
            position = self.rounds.position() if self.leader else self.position
            lr = diloco.inner_lr_at(position, inner_lr=cfg.inner_lr, warmup_steps=cfg.warmup_steps,
                                    total_steps=cfg.total_steps, min_lr_ratio=cfg.min_lr_ratio)
            for group in self.opt.param_groups:
                group["lr"] = lr
            t_data = time.perf_counter()
            try:
                x, y = (t.to(self.device, non_blocking=True) for t in self.feed.next())
            except Stopped:  # stopped while waiting for a shard to read: the loop's top ends it
                continue
            self.data_s += time.perf_counter() - t_data
            self.timer.start()
            with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                loss = model(x, y)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            step_s = self.timer.stop()
            if cfg.slowdown > 1:
                time.sleep(step_s * (cfg.slowdown - 1))
            if self.leader:
                self.after_step(loss.detach(), tokens_per_step)
        self.finish_training()

    def after_step(self, loss: Optional[torch.Tensor], tokens: int) -> bool:
        """Count one inner step (its loss, its tokens), then the round driver's work at this step
        boundary (outer.py), then every log interval the status line and our records. True when an
        outer step was applied (the local weights moved onto a new anchor)."""
        self.inner_step += 1
        self.tokens += tokens
        if loss is not None:
            self._loss_sum = self._loss_sum + loss  # a tensor on the device: no sync per step
            self._loss_n += 1
        applied = self.rounds.at_step_boundary(self.inner_step, tokens)
        now = time.monotonic()
        if now - self._last_log >= self.cfg.log_interval:
            self.last_loss = float(self._loss_sum) / self._loss_n if self._loss_n else math.nan
            tps = (self.tokens - self._tokens_at_log) / (now - self._last_log)
            self._log_inner(tps)
            self._loss_sum, self._loss_n, self._tokens_at_log, self._last_log = 0.0, 0, self.tokens, now
        return applied

    def finish_training(self) -> None:
        """After the loop: let the last round land (after a budget, not a signal), then the final
        evaluation and checkpoint."""
        wall_s = time.monotonic() - self.t_start
        if self.feed is not None:
            self.feed.close()
        if self.leader:
            self.rounds.finish(wait=not self.stop_event.is_set())
            if self.records is not None:  # the others stop counting us at their next read
                self.records.leave(self._progress_record(0.0))
        self.timer.drain(wait=True)
        extra = {}
        if self.ranks:  # one last copy of the leader's weights, then check that every rank holds them
            self._sync_ranks(True)
            extra = dict(ranks=self.ranks.world_size, rank_spread=self.ranks.spread(self.model))
        if not self.leader:
            return
        if self.claims is not None:
            self.claims.release()
            self.shard_source.announce(set())
        t0 = time.perf_counter()
        eval_loss = self.evaluator.final()
        if self.outer.average is not None:  # the model a user keeps: the anchors' average
            kept_eval_loss, _ = self._evaluate_anchor(kept=True)
            extra.update(kept_eval_loss=kept_eval_loss, kept_eval_bpb=self.bits_per_byte(kept_eval_loss))
        self.eval_s += time.perf_counter() - t0
        split = self.time_split(wall_s)
        self.metrics.log("final", inner_step=self.inner_step, outer_step=self.outer_step, eval_loss=eval_loss,
                         eval_bpb=self.bits_per_byte(eval_loss), tokens=self.tokens, data_s=self.data_s,
                         compute_s=self.compute_s, outer_s=self.outer_s, eval_s=self.eval_s, wall_s=wall_s,
                         eval_bg_s=self.evaluator.spent_s, evals=self.evaluator.count, split=split,
                         final_wait_s=time.monotonic() - self.t_start - wall_s, **extra)
        self._progress("p2pdiloco: wall time " + "  ".join(f"{k} {v:.1%}" for k, v in split.items())
                       + f"  (evaluations in the background: {self.evaluator.count}, "
                         f"{self.evaluator.spent_s:.1f}s)")
        self._save_checkpoint(wait=True)

    def time_split(self, wall_s: float) -> dict:
        """Where the training thread's wall time went: inner steps, waiting for data, round boundaries,
        evaluation in this thread (the final one), and the rest (logging, the step loop's own work)."""
        parts = {"inner_steps": self.compute_s, "data": self.data_s, "boundary": self.outer_s}
        parts["rest"] = max(0.0, wall_s - sum(parts.values()))
        return {k: round(v / wall_s, 5) if wall_s > 0 else 0.0 for k, v in parts.items()}

    def _sync_ranks(self, stop: bool) -> bool:
        """Once per inner step on every rank: the leader's stop decision, schedule position and,
        when a round or a resync moved its weights, the weights themselves."""
        changed = self.leader and self.rounds.params_changed
        stop, changed, self.position = self.ranks.control(
            [int(stop), int(changed), self.rounds.position() if self.leader else 0])
        if changed:
            self.ranks.broadcast_params(self.model)
            if self.leader:
                self.rounds.params_changed = False
        return bool(stop)

    def _should_stop(self, t_start: float) -> bool:
        return (self.stop_event.is_set() or self._out_of_time(t_start)
                or (self.cfg.max_inner_steps > 0 and self.inner_step >= self.cfg.max_inner_steps))

    def _out_of_time(self, t_start: float) -> bool:
        return self.cfg.max_time > 0 and time.monotonic() - t_start >= self.cfg.max_time

    def _log_inner(self, tokens_per_s: float) -> None:
        """The status line and inner metrics; our records go to the records thread (no DHT call here)."""
        self.metrics.log("inner", inner_step=self.inner_step, outer_step=self.outer_step, loss=self.last_loss,
                         tokens=self.tokens, tokens_per_s=tokens_per_s, compute_s=self.compute_s, data_s=self.data_s,
                         outer_s=self.outer_s, eval_s=self.eval_s,
                         **({"data": self.claims.position()} if self.claims is not None else {}))
        self.metrics.status(f"[{self.peer_id[-6:]}] step {self.inner_step:6d}  outer {self.outer_step:4d}  "
                            f"loss {self.last_loss:6.3f}  {tokens_per_s:8.0f} tok/s")
        self.records.publish(self._progress_record(tokens_per_s))

    def _progress_record(self, tokens_per_s: float) -> dict:
        """What `status` and `monitor` show of this peer: its status record, whose PROGRESS_FIELDS are also
        its progress record (what the schedule, the grid and the staleness check read)."""
        return {"outer_step": self.outer_step, "inner_step": self.inner_step, "loss": self.last_loss,
                "tokens_per_s": tokens_per_s, "tokens": self.tokens, "device": self.device_name,
                "maddrs": self.maddrs[:4], "reachability": self.reach.mode,
                "group_size": 0, "rounds_applied": 0, "rounds_failed": 0,  # before training (wait_for_peers)
                "eval_loss": self.last_eval_loss, "time": time.time(),
                **({"data": self.claims.position()} if self.claims is not None else {}),
                **({"banned": self.suspects.record()} if self.suspects.banned() else {}),
                **(self.rounds.record() if self.rounds is not None else {})}

    def bits_per_byte(self, loss: Optional[float]) -> Optional[float]:
        """A held-out loss in bits per byte of text (None without our own data)."""
        return None if loss is None or self.data is None else round(self.data.bits_per_byte(loss), 5)

    def _evaluated(self, outer_step: int, loss: Optional[float], seconds: float) -> None:
        """An evaluation of the anchor at outer_step is done (the evaluator's thread, or the final one)."""
        if loss is None:
            return
        self.last_eval_loss = loss
        self.metrics.log("eval", outer_step=outer_step, eval_loss=loss, eval_bpb=self.bits_per_byte(loss),
                         eval_s=seconds)

    @torch.no_grad()
    def _evaluate_anchor(self, *, kept: bool = False) -> tuple[Optional[float], int]:
        """(Loss of the anchor (the swarm's model), or with kept of the model this peer keeps (the anchors'
        average), on the held-out batches, or the caller's eval_fn on it; None when there is nothing to
        evaluate with; the anchor's outer step). Runs beside the training: our own model's evaluation
        module takes views of the anchor as its parameters (torch.func.functional_call), so on the CPU no
        copy of the model is made and the state lock is held throughout (the round's thread waits to move
        the anchor); on a GPU the anchor is copied there under the lock, then evaluated without it."""
        outer = self.outer
        if self.eval_fn is not None:
            with outer.lock:
                load_flat_(self.eval_model, outer.kept() if kept else outer.anchor)
                outer_step = outer.step
            return float(self.eval_fn(self.eval_model)), outer_step
        if self.eval_set is None:
            return None, outer.step
        on_cpu = self.device.type == "cpu"
        with outer.lock:
            outer_step = outer.step
            weights = outer.kept() if kept else outer.anchor
            flat = weights if on_cpu else weights.to(self.device)
            if on_cpu:
                return self._held_out_loss(flat), outer_step
        return self._held_out_loss(flat), outer_step

    def _held_out_loss(self, flat: torch.Tensor) -> float:
        params, offset = {}, 0
        for name, p in self.model.named_parameters():
            params[name] = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        params.update(self.model.named_buffers())
        losses = []
        for x, y in self.eval_set:
            with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                loss = torch.func.functional_call(self.eval_model, params, (x.to(self.device), y.to(self.device)))
            losses.append(loss)
        return float(torch.stack(losses).mean())

    # --------------------------------------------------------------------------- stop

    def close(self) -> None:
        """Stop the averager and the DHT (and its p2pd); safe to call more than once."""
        if self.averager is not None:
            try:
                self.averager.shutdown()  # cancels a round in flight
            except Exception as e:  # keep stopping the DHT whatever happened here
                logger.warning(f"averager shutdown failed: {e!r}")
            self.averager = None
            if self.rounds is not None:
                self.rounds.averager = None  # a round's thread still settling must not touch it
        # let DHT calls in flight (a round's verdict, a progress read) finish before the DHT goes:
        # hivemind's DHT can hang on shutdown when a request arrives while it stops
        for part in (self.feed, self.records, self.evaluator):
            if part is not None:
                part.close()
        pending = self.rounds.pending if self.rounds is not None else None
        if pending is not None:
            try:
                pending.future.result(timeout=2.0)
            except Exception as e:  # a failed or cancelled request is fine at this point
                logger.debug(f"request in flight at shutdown: {e!r}")
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        if self.metrics is not None:
            self.metrics.close()
        if self.ranks is not None:
            self.ranks.close()
