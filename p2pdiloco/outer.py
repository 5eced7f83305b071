"""What a peer does with the swarm between inner steps: hand a pseudo-gradient to a background
round, apply the round's outcome as one outer step, and keep up with the swarm's progress.

Per round (see diloco.py for the math, averaging.py for the round itself):

    start:  snapshot the local weights; pseudo_grad = anchor - snapshot; the round runs in the
            background. Eager (`eager_outer`): train meanwhile from preview_outer_step(anchor,
            momentum, own pseudo_grad), not from the snapshot (arXiv 2502.12996).
    finish: a merge round (members' anchors differed) first takes the merged anchor and
            momentum; then one Nesterov step with the group's average; the local progress made
            since the round started moves onto the new anchor. A failed round only moves the
            eager preview's progress back onto our own anchor: nothing is lost, the next round
            carries it.
    full groups (`full_groups`): a group forms once every live peer is in, and every member
            counts its next inner_steps from the moment the group formed, so the next round
            finds them all ready at once. With `matchmaking_lead` (off: measured worse), it enters
            matchmaking ahead of that by the group's mean wait for its last member.
    schedule (`schedule`): once a group has formed, the members enter the next round at the due
            time they all derive from the group's announcements (schedule.py), not by counting steps.

Who does what: the training thread takes the snapshot (_start_round) and applies the weight
corrections at step boundaries (_finish_round, boundary.py); the round's thread computes the
pseudo-gradient and, once the round is over, everything the outcome means (_settle_round: the
merge, the outer step, the correction). Anchor, momentum and outer step (OuterState) change only in
the round's thread (or in a resync, between rounds), under the state's lock.

    >>> outer = OuterState(state.SharedState(numel))
    >>> rounds = Rounds(cfg, outer=outer, model=model, boundary=Boundary(params, numel=numel), ...)
    >>> rounds.begin(inner_step=0)
    >>> applied = rounds.at_step_boundary(inner_step, tokens)   # after every inner step
    >>> rounds.finish(wait=True)                                # after the loop: land the last round
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import os
import resource
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from p2pdiloco import diloco, grid, schedule, state, swarm
from p2pdiloco.averaging import RoundOutcome, contribution_weight
from p2pdiloco.boundary import Boundary
from p2pdiloco.model import flat_params, load_flat_

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


# Test-only: make this peer a malicious volunteer that sends a crafted pseudo-gradient instead of its own
# (attack_for_test; scripts/bench.py byzantine). "lie:K" is a lying reducer, played by the averager process:
# this peer then sends its honest pseudo-gradient.
TEST_ATTACK = os.environ.get("P2PDILOCO_TEST_ATTACK", "")
SENDER_ATTACK = "" if TEST_ATTACK.startswith("lie:") else TEST_ATTACK


def attack_for_test(how: str, g: torch.Tensor, prev: torch.Tensor, outer_step: int) -> torch.Tensor:
    """What an attacker sends instead of its own pseudo-gradient g, knowing prev, the last group average it
    received (g before its first applied round): "signflip:K" -K g; "alie:Z" prev - Z |g - prev| ("a little
    is enough", arXiv 1902.06156); "ipm:E" -E prev (inner product manipulation, arXiv 1903.03936); "noise" or
    "noise:K" Gaussian noise of K times g's norm (1), the same for the same outer step."""
    kind, _, arg = how.partition(":")
    try:
        k = float(arg) if kind in ("signflip", "alie", "ipm") or (kind == "noise" and arg) else None
    except ValueError:
        k = None
    if k is None and how != "noise":
        raise ValueError(f"P2PDILOCO_TEST_ATTACK must be signflip:K, alie:Z, ipm:E, noise[:K] or lie:K (K, Z, E "
                         f"numbers), got {how!r}")
    if kind == "signflip":
        return -k * g
    if kind == "alie":
        # not omniscient: the paper's attacker knows every honest pseudo-gradient's mean and spread; this one
        # has the last average (an outer step old) and one sample of the spread, its own distance from it
        return prev - k * (g - prev).abs()
    if kind == "ipm":
        return -k * prev
    noise = torch.randn(g.shape, generator=torch.Generator().manual_seed(outer_step)).to(g.device, g.dtype)
    return noise * ((k or 1.0) * g.norm() / noise.norm().clamp_min(1e-12))


if SENDER_ATTACK:  # a typo fails the peer at start, not at its first round
    attack_for_test(SENDER_ATTACK, torch.zeros(1), torch.zeros(1), 0)


@dataclass
class PendingRound:
    """The round in flight, and what applying (or discarding) it needs."""

    future: concurrent.futures.Future  # -> RoundOutcome
    delta: torch.Tensor     # our pseudo-gradient, anchor - snapshot. With the anchor and momentum (which
    # nothing changes while a round is in flight) it gives the snapshot and the eager preview again:
    # 4 bytes per parameter kept instead of 8 (docs/scale.md)
    eager: bool             # the local model trains from the eager preview (else from the snapshot)
    tokens: int             # tokens behind the pseudo-gradient
    weight: float
    age: int                # outer steps behind the swarm when it started
    start_step: int = 0     # our inner step when we entered matchmaking
    started_at: float = 0.0  # time.monotonic() then
    formed_at_step: Optional[int] = None  # our inner step when the group formed (set from the round's thread)
    formed_at: Optional[float] = None     # time.monotonic() then
    own_share: float = 1.0  # the eager preview's weight on our own pseudo-gradient (diloco.preview_outer_step)
    grid: Optional[tuple] = None  # (round, dims, coords) whose line we entered (grid.py), with a schedule
    late: Optional[float] = None  # seconds after the scheduled due time that we entered (the phase error)
    entered: Optional[float] = None  # wall-clock time we entered matchmaking (time.time(), like the due times)
    # set by the round's thread when it settles the outcome (_settle_round)
    applied: bool = False   # an outer step moved the anchor; the weights' correction is staged
    resync_to: int = 0      # our anchor differs from the group's: download a state at least this new
    spread: float = 0.0     # of the members' anchor digests
    diverged: int = 0       # members whose anchor differed from the newest member's
    share: float = 1.0      # group_share's scale of the average
    digest: Optional[list] = None  # of the new anchor
    # the training thread's cost of this round (boundary.py): seconds and page faults
    boundary_s: float = 0.0
    faults: int = 0
    start_s: float = 0.0    # of which at the round's start (the snapshot)
    preview_s: float = 0.0  # and applying the eager preview's correction

    def add_cost(self, part: str, cost: dict) -> None:
        """Count a part of the round's boundary ("start", "preview", "finish") that _on_boundary measured."""
        self.boundary_s += cost["s"]
        self.faults += cost["faults"]
        if part != "finish":
            setattr(self, f"{part}_s", getattr(self, f"{part}_s") + cost["s"])


def thread_faults() -> int:
    """Page faults of the calling thread so far (minor + major; 0 where RUSAGE_THREAD is missing)."""
    try:
        usage = resource.getrusage(resource.RUSAGE_THREAD)
    except (AttributeError, OSError):
        return 0
    return usage.ru_minflt + usage.ru_majflt


def _param_slices(model: torch.nn.Module, flat: torch.Tensor):
    """(parameter, the matching slice of a flat vector) for each parameter, in flat_params order."""
    offset = 0
    for param in model.parameters():
        yield param, flat[offset:offset + param.numel()]
        offset += param.numel()


class OuterState:
    """The swarm's model as this peer holds it: the anchor, its outer momentum and the outer step.
    Anchor and momentum live in shared memory (state.SharedState), which the averager process serves
    to joiners; all three change only inside `updating()` (the round's thread, a resync, a resume),
    which holds `lock` and publishes the new version, so that a download discards what it copied
    meanwhile. Readers that need them consistent (the evaluator, the checkpoint writer) take `lock`.

    `average` (with average_weight > 0) is the model the peer keeps: a moving average of the anchors its
    outer steps made, average += max(w, 1/n) (anchor - average) at the n-th (diloco.fold_average): their
    mean until there are 1/w of them, then an exponential moving average, so that a short run's average
    does not lean on its first anchor. A new anchor from elsewhere (the start, a download, a checkpoint
    without an average) starts it again: until our next outer step the average is that anchor. It lives on
    the training device (a GPU peer's host memory does not grow; a CPU peer's grows by 4 bytes a parameter)."""

    def __init__(self, shared: state.SharedState, *, average_weight: float = 0.0,
                 device: torch.device | str = "cpu"):
        self.shared = shared
        self.anchor, self.momentum = shared.anchor, shared.momentum  # changed in place only
        self.step = 0
        self.lock = threading.Lock()
        self.digest_idx = diloco.digest_indices(shared.numel)
        self.average_weight = average_weight
        self.averaged = 0  # anchors of our outer steps in the average since it last started again
        self.average: Optional[torch.Tensor] = (torch.empty(shared.numel, device=device)
                                                if average_weight > 0 else None)

    @contextlib.contextmanager
    def updating(self, *, stepped: bool = False):
        """Change anchor, momentum and step. stepped: an outer step moved the anchor (the average takes it
        in); otherwise the anchor was replaced (the average starts from it)."""
        with self.lock, self.shared.writing():
            yield
            self.shared.publish(self.step, self.digest_idx)
            if self.average is not None:
                self.averaged = self.averaged + 1 if stepped else 0
                weight = max(self.average_weight, 1.0 / self.averaged) if stepped else 1.0
                diloco.fold_average(self.average, self.anchor, weight)

    def load(self, anchor: torch.Tensor, momentum: torch.Tensor, step: int) -> None:
        """Take another state (a download, a checkpoint), copied in place."""
        with self.updating():
            self.anchor.copy_(anchor.reshape(-1))
            self.momentum.copy_(momentum.reshape(-1))
            self.step = int(step)

    def kept(self) -> torch.Tensor:
        """The model this peer keeps: the anchors' average, or the anchor itself (average_weight 0). Hold `lock`."""
        return self.anchor if self.average is None else self.average

    def digest(self) -> list[float]:
        """A few anchor values at fixed positions: members compare them to tell equal anchors."""
        return diloco.anchor_digest(self.anchor, self.digest_idx)


class Rounds:
    """The round driver a peer owns. The training thread calls `at_step_boundary` after every inner
    step; the driver hands a pseudo-gradient to a background round when one is due, applies the
    corrections the round's thread staged, and lands a round that came back. It keeps what that
    needs of the swarm (its size and outer step, the schedule's clock, our cell of the grid) and the
    counts behind the next contribution; the parts it drives are the peer's, passed in: the outer
    state, the boundary's buffers, the averager and its round runner, the records, the evaluator."""

    def __init__(self, cfg, *, outer: OuterState, model: Optional[torch.nn.Module], boundary: Boundary, numel: int,
                 metrics, suspects, averager=None, runner=None, dht=None, records=None, evaluator=None,
                 peer_id: Optional[str] = None, merging: bool = False, stop_event: Optional[threading.Event] = None,
                 save_checkpoint: Callable[[], None] = lambda: None, say: Callable[[str], None] = lambda msg: None,
                 out_of_time: Callable[[], bool] = lambda: False):
        """say: prints a line for the user; out_of_time: the run's budget is spent (synchronous rounds
        stop waiting); save_checkpoint: every checkpoint_every outer steps."""
        self.cfg, self.outer, self.model, self.boundary, self.numel = cfg, outer, model, boundary, numel
        self.metrics, self.suspects, self.averager, self.runner, self.dht = metrics, suspects, averager, runner, dht
        self.records, self.evaluator, self.peer_id, self.merging = records, evaluator, peer_id, merging
        self.stop_event = stop_event or threading.Event()
        self.save_checkpoint, self.say, self.out_of_time = save_checkpoint, say, out_of_time
        self.pending: Optional[PendingRound] = None
        self.clock: Optional[schedule.Clock] = None  # rounds on a schedule (begin)
        self.grid_coords: Optional[list] = None  # our cell of the grid (grid.py), once a group re-indexed us
        self.group_bits = ""  # the averager's group key bits (hivemind's bucket): our line of the grid
        self._attack_prev: Optional[torch.Tensor] = None  # SENDER_ATTACK: the last group average this peer received
        self.inner_step = 0
        self.steps_since_round = 0
        self.tokens_since_anchor = 0  # tokens behind the current pseudo-gradient
        self.swarm_outer_step = outer.step
        self.swarm_size = 1  # live peers we can group with, by their progress records (_count_swarm)
        self.live_peers: set[str] = set()  # the others with a progress record, banned or not
        # members that vanished from one of our rounds (killed, crashed, cut off) -> [the newest `time` of their
        # progress records by the first read after, whether that read came]: not counted until a newer record
        # comes (a dead peer's record lives on until it expires, and every group would wait out the matchmaking
        # window for it). Stamps, not record contents: reads can return an older replica of a record
        self.gone: dict[str, list] = {}
        self._stamps: dict[str, float] = {}  # peer -> the newest `time` of its progress records we read
        self.due_steps = cfg.inner_steps  # inner steps per contribution (dynamic_inner_steps scales them)
        self.lead_steps, self.lead_s, self.last_wait_s = 0, 0.0, None  # matchmaking_lead
        # eager outer updates need training while a round runs (not synchronous DiLoCo)
        self.eager = cfg.eager_outer and not cfg.sync_rounds and cfg.outer_apply == "group"
        self.kept: Optional[torch.Tensor] = None  # local progress to place on the next anchor (a resync)
        self.params_changed = False  # the local weights were rewritten: a torchrun peer's other ranks copy them
        # the training thread's seconds at rounds' boundaries: the snapshot, the corrections of the weights,
        # the bookkeeping of a round's landing, any resync download
        self.outer_s = 0.0
        self.last_group_size = 0  # of the last applied round; with the counters, for `status` and `monitor`
        self.rounds_applied = self.rounds_failed = 0
        self._awaiting_read = -math.inf  # after a freeze: no round before the others' records are read (until then)
        self._last_step = time.monotonic()

    def begin(self, inner_step: int) -> None:
        """At the start of training: the schedule's clock, and for a joiner the swarm's phase."""
        cfg = self.cfg
        self.inner_step = inner_step
        self.swarm_outer_step = self.outer.step
        self._last_step = time.monotonic()
        if cfg.schedule and not cfg.sync_rounds:
            self.clock = schedule.Clock(inner_steps=cfg.inner_steps, now=time.time(), inner_step=inner_step,
                                        window=cfg.matchmaking_time, mono=time.monotonic(),
                                        group_size=cfg.target_group_size if cfg.grid else 0)
            if cfg.initial_peers:  # a joiner enters the swarm's phase at its first round
                self._check_swarm_outer_step()

    def position(self) -> int:
        """Inner steps along the run, for the inner learning rate's schedule."""
        return self.outer.step * self.cfg.inner_steps + self.steps_since_round

    def record(self) -> dict:
        """Our part of the progress record: rounds, the schedule, our cell."""
        return {"group_size": self.last_group_size, "rounds_applied": self.rounds_applied,
                "rounds_failed": self.rounds_failed, **(self.clock.record() if self.clock else {}),
                **({"cell": self.grid_coords} if self.grid_coords is not None else {})}

    def at_step_boundary(self, inner_step: int, tokens: int) -> bool:
        """After inner step `inner_step` (`tokens` more behind our pseudo-gradient): apply a weight
        correction that a round staged; land a round that came back; hand the pseudo-gradient to a
        background round when one is due. True when an outer step was applied (the local weights moved
        onto a new anchor)."""
        cfg = self.cfg
        # a gap longer than a round could take: we were frozen (SIGSTOP, suspend, swap); the swarm
        # moved on, so look at where it is before contributing anything
        now = time.monotonic()
        if now - self._last_step > cfg.allreduce_timeout:
            if self.clock is not None:  # our due time passed while we slept: take the swarm's phase
                self.clock.in_phase = False
            self.records.ask_read()
            self._awaiting_read = now + 10.0
        self._last_step = now
        self.inner_step = inner_step
        self.steps_since_round += 1
        self.tokens_since_anchor += tokens
        found = self.records.take_read()
        if found is not None:  # the others' progress records, read by the records thread
            self._note_progress(found)
            self._awaiting_read = -math.inf

        # --- a correction staged by the round's thread: the eager preview ------------------
        if self.pending is not None and self.boundary.ready() and not self.pending.future.done():
            with self._on_boundary() as cost:
                if self.boundary.apply_ready() is not None:
                    self.params_changed = True
            self.pending.add_cost("preview", cost)

        # --- outer step: a round came back -----------------------------------------
        applied = False
        if self.pending is not None and self.pending.future.done():
            pending, self.pending = self.pending, None
            applied = self._finish_round(pending)

        # --- every inner_steps steps: hand the pseudo-gradient to a background round ----
        if self.pending is None and now >= self._awaiting_read:
            enter = (self.clock.should_enter(now=time.time(), inner_step=inner_step, mono=time.monotonic())
                     if self.clock else None)
            if enter is None:  # no schedule (yet): every inner_steps steps
                enter = self.steps_since_round >= self.due_steps - self.lead_steps
            if enter:
                with self._on_boundary() as cost:
                    self.pending = self._start_round()
                if self.pending is not None:
                    self.pending.add_cost("start", cost)
                if cfg.sync_rounds:
                    applied = self._wait_round_sync() or applied
        return applied

    def finish(self, *, wait: bool) -> None:
        """After the loop: land the round in flight, waiting for it up to a round's bound if `wait`."""
        if self.pending is not None and wait:
            concurrent.futures.wait([self.pending.future], timeout=self._round_bound())
        if self.pending is not None and self.pending.future.done():
            pending, self.pending = self.pending, None
            self._finish_round(pending)

    def _install(self, loaded: state.LoadedState, *, keep_local: bool, tokens_kept: int = 0) -> None:
        """Adopt a downloaded anchor; keep_local keeps the progress made since the last snapshot
        (tokens_kept tokens) and contributes it at once, to land in the same matchmaking window
        as the group it fell behind: waiting inner_steps would miss it and diverge again."""
        if keep_local and self.kept is None:  # progress since our own anchor
            self.kept = flat_params(self.model) - self.outer.anchor
        self.outer.load(loaded.anchor, loaded.momentum, loaded.outer_step)  # views of the averager's idle buffer
        self.averager.release_staging()  # `loaded` was a view of it
        if keep_local:
            self._place_progress()
        else:
            self.kept = None
            load_flat_(self.model, self.outer.anchor)
        self.params_changed = True
        self.tokens_since_anchor = tokens_kept if keep_local else 0
        self.steps_since_round = self.cfg.inner_steps if keep_local else 0
        if not self.averager.client_mode:
            self.averager.state_sharing_priority = float(self.outer.step)

    def _round_bound(self) -> float:
        """The longest a round can take: matchmaking, all-reduce, verdicts."""
        cfg = self.cfg
        return cfg.matchmaking_time * 2 + cfg.request_timeout + cfg.allreduce_timeout + cfg.verdict_timeout + 5

    def _wait_round_sync(self) -> bool:
        """Synchronous DiLoCo: no training until a full round applies (retried while the group is short)."""
        while self.pending is not None and not self.stop_event.is_set() and not self.out_of_time():
            concurrent.futures.wait([self.pending.future], timeout=0.5)
            if self.pending.future.done():
                pending, self.pending = self.pending, None
                if self._finish_round(pending):
                    return True
                del pending  # its pseudo-gradient (4 B/param) goes before the next round's is made
                self.pending = self._start_round()  # same pseudo-gradient: we have not trained since
        return False

    def _full_group(self) -> int:
        """How many members a full group holds: every live peer up to target_group_size, or with a grid
        the used cells of our line (grid.line_size: about N**(1/dims), fewer on a short line)."""
        if self.clock is not None and self.cfg.grid and self.clock.dims > 1:
            coords = grid.fit(self.grid_coords or [], self.clock.dims, self.cfg.target_group_size, self.peer_id,
                              self._grid_peers())
            return grid.line_size(coords, round_=self.clock.round, dims=self.clock.dims,
                                  size=self.cfg.target_group_size, live=self.swarm_size)
        return min(self.cfg.target_group_size, self.swarm_size)

    def _enter_line(self) -> tuple[Optional[tuple], Optional[str]]:
        """With a grid (a swarm beyond one group): this round's line of the grid (grid.py), as (round,
        dims, coords), and the averager's new group key bits if they change (the round's thread sets
        them; DilocoAverager keeps hivemind from moving them); the group key is unchanged while the swarm
        fits in one group."""
        if not self.cfg.grid:
            return None, None
        size, dims = self.cfg.target_group_size, self.clock.dims
        self.grid_coords = coords = grid.fit(self.grid_coords or [], dims, size, self.peer_id, self._grid_peers())
        bits = grid.key_bits(coords, round_=self.clock.round, dims=dims, size=size)
        changed = bits != self.group_bits
        self.group_bits = bits
        return (self.clock.round, dims, coords), (bits if changed else None)

    def _settle_cell(self, records: dict) -> None:
        """Move off a cell that another peer holds, or that lies outside the part of the grid the live
        peers fill (grid.settle), by the cells in the records of peers at our round."""
        size, dims = self.cfg.target_group_size, self.clock.dims
        cells = grid.cells_of(records, me=self.peer_id, round_=self.clock.round, dims=dims, size=size)
        coords = grid.fit(self.grid_coords or [], dims, size, self.peer_id, self._grid_peers())
        self.grid_coords = grid.settle(self.peer_id, coords, cells, live=self.swarm_size, dims=dims, size=size,
                                       salt=self.clock.round)

    def _leave_line(self, pending: PendingRound, members: dict) -> None:
        """A group formed on our line (members: peer id -> its gather): the coordinates the members held
        along its free dimension are dealt out again (grid.reindex, Moshpit's re-indexing), so the next
        lines each hold one member of this one."""
        if pending.grid is None or self.peer_id not in members:
            return
        round_, dims, coords = pending.grid
        cells = {peer: gather.get("cell") if isinstance(gather, dict) else None for peer, gather in members.items()}
        self.grid_coords = grid.reindex(coords, round_=round_, dims=dims, size=self.cfg.target_group_size,
                                        me=self.peer_id, cells=cells)

    def _check_swarm_outer_step(self) -> None:
        """Blocking read of the swarm's outer step (after a freeze, before the next contribution)."""
        try:
            records = swarm.read_progress(self.dht, self.cfg, timeout=10.0)
        except Exception as e:  # the DHT may be slow right after a freeze; the digest check still guards
            logger.warning(f"could not read the swarm's progress: {e!r}")
            return
        self._note_progress(records)

    def _count_swarm(self) -> None:
        """The live peers we can group with: those with a progress record, ourselves, none we banned and none
        that vanished from a round of ours without publishing since."""
        self.swarm_size = len(self._grid_peers())

    def _grid_peers(self) -> set:
        """The live peers we can group with (_count_swarm), ourselves included: a first cell of the grid is our
        rank among them (grid.place)."""
        return (self.live_peers - self.suspects.banned() - set(self.gone)) | {self.peer_id}

    def _note_gone(self, peers: list) -> None:
        """Members that vanished from our round (their parts or their verdict never came)."""
        for peer in peers:
            if peer != self.peer_id:
                self.gone[peer] = [self._stamps.get(peer, -math.inf), False]

    def _forget_returned(self, records: dict) -> None:
        """A vanished member counts again once it publishes a record newer than any we read before the next
        read after it vanished (it is alive: a straggler, or a peer cut off for a moment); a dead one stays
        out until its record expires."""
        for peer, record in records.items():
            stamp = record.get("time")
            if isinstance(stamp, (int, float)) and math.isfinite(stamp):
                self._stamps[peer] = max(stamp, self._stamps.get(peer, -math.inf))
        for peer, (newest, settled) in list(self.gone.items()):
            stamp = self._stamps.get(peer, -math.inf)
            if peer not in records or (settled and stamp > newest):
                del self.gone[peer]
            elif not settled:  # its last record before it vanished may only show now: the baseline
                self.gone[peer] = [stamp, True]
        self._stamps = {peer: stamp for peer, stamp in self._stamps.items() if peer in records}

    def _note_progress(self, records: dict) -> None:
        # a peer we banned is not part of our swarm: it cannot join our groups, so counting it would make every
        # group wait out the matchmaking window for it and never count as whole, and its record must not set
        # our phase, our grid cell or the outer step we resync to (docs/security.md, "After a ban")
        records = {peer: record for peer, record in records.items() if not record.get("left")}  # stopped
        self.live_peers = set(records)  # records expire; a peer that stopped cleanly said so
        self._forget_returned(records)
        records = {peer: record for peer, record in records.items() if peer not in self.suspects.banned()}
        self.swarm_outer_step = max([self.outer.step, *(r.get("outer_step", 0) for r in records.values())])
        self._count_swarm()
        if self.clock is not None:
            self.clock.observe(records)
        if self.clock is not None and not self.clock.in_phase and self.clock.adopt(records, now=time.time()):
            logger.info(f"rounds: took the swarm's phase (next round in {self.clock.due - time.time():.1f}s, "
                        f"every {self.clock.period:.1f}s)")
        if self.clock is not None and self.cfg.grid and self.clock.dims > 1:
            self._settle_cell(records)
        if self.cfg.dynamic_inner_steps and not self.cfg.sync_rounds:
            speeds = {peer: r.get("tokens_per_s") for peer, r in records.items()}
            self.due_steps = diloco.dynamic_inner_steps(self.cfg.inner_steps, speeds.get(self.peer_id),
                                                        list(speeds.values()))

    # ------------------------------------------------------------------------- rounds

    def _start_round(self):
        """Hand a round its pseudo-gradient. Here, in the training thread: one snapshot of the weights
        and the round's announcement; the rest (pseudo-gradient, digest, eager preview, the averager's
        settings) runs in the round's thread, in buffers allocated once (boundary.py)."""
        cfg = self.cfg
        age = max(0, self.swarm_outer_step - self.outer.step)
        too_stale = age > cfg.max_staleness
        if too_stale and not self.merging:
            self._resync(f"{age} outer steps behind the swarm", keep_local=False)
            return None
        self.boundary.snapshot()
        # per_contribution: equal weights, so slot j of the average is member j's pseudo-gradient / group size
        weight = 1.0 if cfg.outer_apply == "per_contribution" else contribution_weight(self.tokens_since_anchor, age)
        if too_stale:  # a zero pseudo-gradient must not dilute the others' average
            weight = 0.0
        gather = {"peer": self.peer_id, "outer_step": self.outer.step, "tokens": self.tokens_since_anchor,
                  "swarm": self.swarm_size, "waited": self.last_wait_s}
        line = late = bits = None
        if self.clock is not None:  # our due time and speed: the group derives its next due time from them
            line, bits = self._enter_line()
            if line is not None:  # our cell, for the members to deal out the line's cells after the round
                gather["cell"] = list(line[2])
            gather.update(self.clock.announce(now=time.time(), inner_step=self.inner_step, swarm_size=self.swarm_size,
                                              mono=time.monotonic()))
            late = time.time() - gather["due"]
        target = None
        if cfg.full_groups:  # everyone live (or our whole line) is expected: the group forms once they are all in
            live = self._full_group()
            target = live if live >= max(2, cfg.min_group_size) else cfg.target_group_size
        # eager_mix: our pseudo-gradient is about 1/N of the group's average, the others' come from momentum
        own_share = 1.0 / max(1, self._full_group()) if cfg.eager_mix else 1.0
        eager = self.eager
        self.steps_since_round = 0
        outer_step = self.outer.step

        def pseudo_grad():  # in the round's thread
            if bits is not None:
                self.averager.set_group_bits(bits, wait=False)
            if target is not None:
                self.averager.set_target_group_size(target)
            with self.outer.lock:
                delta = self.boundary.pseudo_grad_(self.outer.anchor)
                digest = self.outer.digest()
                # no copies: the round copies them into its buffer before it can finish, and only a
                # finished round (or a resync between rounds) changes them
                anchor, momentum = (self.outer.anchor, self.outer.momentum) if self.merging else (None, None)
            if too_stale:  # too old to help: contribute nothing, take the group's anchor in the merge round
                delta.zero_()
            sent = delta  # what goes to the group; the eager preview below takes our own, honest delta
            if TEST_CORRUPT.startswith("anchor_") and anchor is not None:  # its digest differs: every round merges
                anchor = corrupt_for_test(anchor, TEST_CORRUPT.removeprefix("anchor_"))
                digest = [v + 1.0 for v in digest]
            elif TEST_CORRUPT:  # only the outgoing values: a faulty sender's own model must not blow up first
                sent = corrupt_for_test(delta, TEST_CORRUPT)
            elif SENDER_ATTACK:
                prev = self._attack_prev if self._attack_prev is not None else delta
                sent = attack_for_test(SENDER_ATTACK, delta, prev, outer_step)
            if eager:  # train the round in flight from where the anchor will about be (arXiv 2502.12996)
                self.boundary.stage_preview(self.outer.momentum, cfg, own_share=own_share)
            return sent, anchor, momentum, {"digest": digest}

        def formed() -> None:  # in the round's thread
            pending.formed_at_step, pending.formed_at = self.inner_step, time.monotonic()
            self.metrics.log("allreduce_started", outer_step=outer_step)

        pending = PendingRound(None, self.boundary.delta, eager, self.tokens_since_anchor, weight, age,
                               start_step=self.inner_step, started_at=time.monotonic(), own_share=own_share,
                               grid=line, late=late, entered=time.time())
        pending.future = self.runner.start(pseudo_grad, weight=weight, gather=gather, on_allreduce=formed,
                                           settle=lambda outcome: self._settle_round(pending, outcome))
        return pending

    def _settle_round(self, pending: PendingRound, outcome: RoundOutcome) -> RoundOutcome:
        """In the round's thread, once the round is over: decide what the outcome means for us and do its
        arithmetic (the merged anchor, the outer step, the correction of the local weights that the
        training thread applies at its next step boundary)."""
        averager = self.averager  # None once the peer has closed
        try:
            # the base our local steps train from: the eager preview only if the training thread took it
            pending.eager = self.boundary.take_base() if pending.eager else False
            if not outcome.ok:
                if pending.eager:  # back onto the snapshot: the next pseudo-gradient carries our progress
                    self.boundary.stage_undo(self.outer.momentum, self.cfg, own_share=pending.own_share)
                return outcome
            members = list(outcome.members.values())
            reference = max(members, key=lambda m: (m["outer_step"], m["peer"]))
            mine = outcome.members[self.peer_id]
            pending.spread = max(diloco.digest_spread(m["digest"], reference["digest"]) for m in members)
            merged = outcome.anchor is not None
            if not merged and diloco.digest_spread(mine["digest"], reference["digest"]) > self.cfg.anchor_tolerance:
                pending.resync_to = reference["outer_step"] + 1  # the training thread downloads the state
                return outcome
            pending.diverged = sum(diloco.digest_spread(m["digest"], reference["digest"]) > self.cfg.anchor_tolerance
                                   for m in members)
            # every member derives the same share from the same announcements, so anchors stay equal
            share = diloco.group_share([m.get("swarm", 1) for m in members]) if self.cfg.group_share else 1.0
            pending.share = share

            def move() -> None:  # the anchor and momentum become the new ones, in place
                if merged:  # everyone's anchor and momentum, merged in the round: nobody's progress is lost
                    self.outer.anchor.copy_(outcome.anchor)  # in place: the outcome is a view of the round's buffer
                    self.outer.momentum.copy_(outcome.momentum)
                if self.cfg.outer_apply == "per_contribution":  # the negative control: momentum per contribution
                    for contribution in outcome.average.view(-1, self.numel)[:len(members)]:
                        diloco.outer_step_(self.outer.anchor, self.outer.momentum, contribution * len(members),
                                           outer_lr=self.cfg.outer_lr, outer_momentum=self.cfg.outer_momentum)
                else:
                    diloco.outer_step_(self.outer.anchor, self.outer.momentum, outcome.average, scale=share,
                                       outer_lr=self.cfg.outer_lr, outer_momentum=self.cfg.outer_momentum)
                if SENDER_ATTACK:  # per_contribution holds one slot per member: their sum is the average
                    self._attack_prev = outcome.average.view(-1, self.numel)[:len(members)].sum(0)
                self.outer.step = max(m["outer_step"] for m in members) + 1

            with self.outer.updating(stepped=True):
                self.boundary.stage_outer(self.outer.anchor, self.outer.momentum, self.cfg, preview=pending.eager,
                                          own_share=pending.own_share, move=move)
                pending.digest = self.outer.digest()
            pending.applied = True
            if averager is not None and not averager.client_mode:
                averager.state_sharing_priority = float(self.outer.step)
            return outcome
        finally:  # a merge round's segments (read above) go back to the system
            if averager is not None:
                averager.release_staging()

    def _finish_round(self, pending: PendingRound) -> bool:
        """Land a round that is over, in the training thread: apply the correction its thread staged (one
        fused add), then the bookkeeping. True when an outer step was applied. Logs the training thread's
        cost of the round (a `boundary` record)."""
        with self._on_boundary() as cost:
            outcome: RoundOutcome = pending.future.result()
            if self.boundary.apply_ready() is not None:  # the other ranks of a torchrun peer copy the weights
                self.params_changed = True
            applied = self._land_round(pending, outcome)
        pending.add_cost("finish", cost)
        self.metrics.log("boundary", outer_step=self.outer.step, applied=applied, boundary_s=pending.boundary_s,
                         start_s=pending.start_s, preview_s=pending.preview_s,
                         finish_s=pending.boundary_s - pending.start_s - pending.preview_s, faults=pending.faults,
                         round_s=outcome.round_s)
        return applied

    @contextlib.contextmanager
    def _on_boundary(self):
        """The training thread's seconds and page faults inside the block, in the dict it yields (set at
        the block's end; PendingRound.add_cost counts them for a round), added to outer_s (the run's total)."""
        cost = {"s": 0.0, "faults": 0}
        t0, faults0 = time.perf_counter(), thread_faults()
        try:
            yield cost
        finally:
            cost["s"], cost["faults"] = time.perf_counter() - t0, thread_faults() - faults0
            self.outer_s += cost["s"]

    def _land_round(self, pending: PendingRound, outcome: RoundOutcome) -> bool:
        tokens, weight, age = pending.tokens, pending.weight, pending.age
        if self.clock is not None:  # every member of a formed group leaves it with the same next due time
            if outcome.members:
                self._leave_line(pending, outcome.members)
                # a group that held every live peer leaves everyone in phase; a partial group, or one line of a
                # grid, says nothing of the others' phase: look at the swarm's at the next read
                whole = self.clock.dims <= 1 and len(outcome.members) >= self.swarm_size
                # an applied round's time sets the period's floor (schedule.ROUND_MARGIN); a round that failed by a
                # timeout (a frozen member: 8 s) would stretch the next period to 10 s
                self.clock.after_round(list(outcome.members.values()), full=whole,
                                       round_s=outcome.round_s if outcome.ok else None, now=time.time())
            else:
                self.clock.after_no_group()
        # bad_contribution and reducer_check events; a peer that keeps attacking is banned (suspects.py)
        self.suspects.judge(outcome, self.metrics, self.averager, outer_step=self.outer.step)
        if not outcome.ok:
            self._note_gone(outcome.lost)
        # a ban, or a member that vanished, takes effect in the next round's group size, not at the next read
        self._count_swarm()
        if not outcome.ok:
            self._count_from_formation(pending)
            self.metrics.log("round_failed", reason=outcome.reason, outer_step=self.outer.step,
                             round_s=outcome.round_s, grid=list(pending.grid) if pending.grid else None,
                             late=pending.late, entered=pending.entered, lost=[p[-6:] for p in outcome.lost])
            self.rounds_failed += 1
            logger.info(f"round discarded: {outcome.reason}")
            return False
        if not pending.applied:  # our anchor differs from the group's
            # our progress since the round's base goes onto the downloaded anchor; if no download
            # comes, it goes back onto our snapshot (the pseudo-gradient is kept for that)
            self.kept = self._local_progress(pending, out=torch.empty_like(pending.delta))
            # the reference members apply this round: wait until one of them offers the result
            self._resync(f"anchor differs from the group's (spread {pending.spread:.2e})", keep_local=True,
                         min_outer_step=pending.resync_to, tokens_kept=self.tokens_since_anchor - tokens)
            if self.kept is not None:  # no download came: our progress goes back onto our snapshot
                self.kept = None
                self._undo_preview(pending)
            return False
        members = list(outcome.members.values())
        self.params_changed = True
        self.tokens_since_anchor -= tokens
        if self._count_from_formation(pending):
            self._schedule_lead(pending, members)
        self.swarm_outer_step = max(self.swarm_outer_step, self.outer.step)
        report = outcome.report
        self.last_group_size = len(members)
        self.rounds_applied += 1
        if self.outer.step % self.cfg.eval_every == 0:
            self.evaluator.request(self.outer.step)
        self.metrics.log("outer", outer_step=self.outer.step, group_size=len(members), share=pending.share,
                         weight=weight, tokens=tokens, staleness=age, round_s=outcome.round_s,
                         bytes_sent=report.bytes_sent, bytes_recv=report.bytes_recv, anchor_spread=pending.spread,
                         diverged_members=pending.diverged, merged=outcome.anchor is not None,
                         swarm_size=self.swarm_size, members=[m[-6:] for m in sorted(outcome.members)],
                         member_tokens=[outcome.members[m].get("tokens") for m in sorted(outcome.members)],
                         # our reducer's clipping of the members' pseudo-gradients: factors < 1, weight share taken
                         clipped={m[-6:]: round(f, 3) for m, f in report.clipped.items()},
                         merge_clipped={m[-6:]: round(f, 3) for m, f in report.merge_clipped.items()},
                         removed=round(report.removed, 4),
                         grid=list(pending.grid) if pending.grid else None,  # [round, dims, our cell]
                         late=pending.late, entered=pending.entered, lead_steps=self.lead_steps,
                         digest=pending.digest)
        if self.outer.step % self.cfg.checkpoint_every == 0:
            self.save_checkpoint()
        return True

    def _count_from_formation(self, pending: PendingRound) -> bool:
        """full_groups: count the next inner_steps from the moment the group formed, the same for every
        member, so that the group's next round finds them all ready at once instead of spread over the
        window. Also after a round that formed and then failed: counting from each member's own start
        then split a fault-free swarm into two halves a window apart, which met again only in merges
        (docs/benchmarks.md, "a failed round splits the swarm"). True if the count was reset."""
        if not self.cfg.full_groups or pending.formed_at_step is None:
            return False
        self.steps_since_round = self.inner_step - pending.formed_at_step
        return True

    def _schedule_lead(self, pending: PendingRound, members: list) -> None:
        """matchmaking_lead: how many steps before the next inner_steps-th one to enter matchmaking,
        from the waits the members reported; our own wait goes into the next round's announcement."""
        self.last_wait_s = pending.formed_at - pending.started_at
        if not self.cfg.matchmaking_lead or self.cfg.sync_rounds:
            return
        steps = self.inner_step - pending.start_step
        step_s = (time.monotonic() - pending.started_at) / steps if steps > 0 else 0.0
        # at most half the matchmaking window (an earlier member would wait past it) and half the steps
        cap_s = min(self.cfg.matchmaking_time / 2, step_s * self.cfg.inner_steps / 2)
        self.lead_s = diloco.matchmaking_lead(self.lead_s, [m.get("waited") for m in members], cap_s=cap_s)
        self.lead_steps = int(self.lead_s / step_s) if step_s > 0 else 0

    def _undo_preview(self, pending: PendingRound) -> None:
        """Eager: move the progress made on the preview back onto the snapshot, when the round is not
        applied: nothing of our own work is lost, the next pseudo-gradient carries it."""
        if pending.eager:
            with torch.no_grad():
                for param, part in _param_slices(self.model, pending.delta):
                    snapshot = self._base(part, pending.delta, eager=False)
                    preview = self._base(part, pending.delta, eager=True, own_share=pending.own_share)
                    param.add_((snapshot - preview).view_as(param))
            self.params_changed = True

    def _base(self, part: torch.Tensor, delta: torch.Tensor, *, eager: bool, own_share: float = 1.0) -> torch.Tensor:
        """The slice `part` (a view of `delta`) of what the local model trained from since the round
        started: the snapshot (anchor - delta), or the eager preview of the outer step."""
        start = part.storage_offset() - delta.storage_offset()
        sl = slice(start, start + part.numel())
        if not eager:
            return self.outer.anchor[sl] - part
        return diloco.preview_outer_step(self.outer.anchor[sl], self.outer.momentum[sl], part,
                                         outer_lr=self.cfg.outer_lr, outer_momentum=self.cfg.outer_momentum,
                                         own_share=own_share)

    def _local_progress(self, pending: PendingRound, *, out: torch.Tensor) -> torch.Tensor:
        """local - base into `out` (may be pending.delta itself, when it is no longer needed): the
        steps we made since the round started, to be kept on whatever anchor comes next. Called
        before the anchor changes."""
        with torch.no_grad():
            for (param, part), (_, result) in zip(_param_slices(self.model, pending.delta),
                                                  _param_slices(self.model, out)):
                base = self._base(part, pending.delta, eager=pending.eager, own_share=pending.own_share)
                result.copy_(param.detach().reshape(-1).to(part.device, part.dtype) - base)
        return out

    def _place_progress(self) -> None:
        """local = anchor + the progress kept by _local_progress (self.kept)."""
        progress, self.kept = self.kept, None
        with torch.no_grad():
            for param, part in _param_slices(self.model, progress):
                offset = part.storage_offset() - progress.storage_offset()
                param.copy_((self.outer.anchor[offset:offset + part.numel()] + part).view_as(param))
        self.params_changed = True

    def _resync(self, reason: str, *, keep_local: bool, min_outer_step: int = 0, tokens_kept: int = 0) -> None:
        self.say(f"p2pdiloco: resyncing state ({reason}) ...")
        loaded = state.download_state(self.averager, self.cfg, self.numel, timeout=self.cfg.state_timeout,
                                      min_outer_step=min_outer_step, stop_event=self.stop_event)
        if loaded is None:
            self.metrics.log("round_failed", reason=f"resync failed: {reason}", outer_step=self.outer.step)
            return
        self._install(loaded, keep_local=keep_local, tokens_kept=tokens_kept)
        self.metrics.log("resync", reason=reason, loaded_outer_step=loaded.outer_step, download_s=loaded.download_s)
