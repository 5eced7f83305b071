#!/usr/bin/env python3
"""A simulated swarm of 16 to 1,024 peers that run the real schedule.Clock and grid.py.

Group sizes, rounds per minute, DHT traffic, the anchors' spread and the mixing time, at sizes no
machine of ours can run for real.

    python scripts/simulate.py                                       # N = 16, 64, 256, 1024
    python scripts/simulate.py --sizes 64 --kill-every 20 --join-every 20  # churn
    python scripts/simulate.py --sizes 64 256 --progress-every 2     # what-if: fresh progress records
    python scripts/simulate.py --sizes 4096 --rounds 15              # about a minute
    python scripts/simulate.py --compare runs/sw-new1/result.json    # predicted vs scale.py swarm's measured
    python scripts/simulate.py --compare R.json --steps-per-s 3.6    # ... with the step rate calibrated

A discrete-event simulation (one heap of events, simulated seconds; nothing sleeps). Each peer holds
a real `schedule.Clock` and a real cell of `grid.py`, and calls them where outer.py and peer.py do:
`should_enter` when it is ready, `announce` into its gather, `after_round` / `after_no_group` when
the round lands, `observe`, `adopt` and `grid.settle` at each progress read, spaced by
`swarm.progress_read_every`. Everything else is a model, with every constant named below:

- Peers: inner steps at a fixed speed each, lognormal around --steps-per-s (sigma --speed-spread).
  Founders start within a second of each other (start_spread), all knowing the swarm's size
  (scale.py's --wait-for-peers). Before a peer's first formed group there is no schedule: it enters every H
  steps. A round runs in the background; its outcome is taken at the next inner step.
- Matchmaking (hivemind's): peers with equal group key bits meet. The first entrant leads; its
  target is min(target_group_size, its swarm size), or with a grid its line's used cells, grid.line_size
  (outer._full_group). Later entrants join it, first come first served; the group forms at once at
  the target, otherwise when the leader's --window ends. Alone at the end: "no group". Key lookups
  themselves take no time.
- A round: ROUND_RTTS round trips (the leader's go, the butterfly's two phases) plus the transfer,
  2 (g-1)/g x the fp16 model (--model-mb) each way at --bandwidth-mbit; then the verdicts, one more.
- Churn: a random live peer dies every --kill-every s and a new one joins every --join-every s
  (exponential gaps, seeded). A member that dies before it published its verdict fails its group's
  round: averaging.py discards a round without every verdict, after verdict_timeout. So the chance
  that a death mid-round fails the round is the share of the round before the verdicts, not a
  constant. A joiner downloads the state (8 bytes per parameter) from one live peer, then reads the
  progress records and adopts the swarm's phase (outer.Rounds.begin).
- Progress records: stored and read every progress_read_every(N seen, the peer's age) s, on its log ticks,
  expiring after max(15, 3 x that); a read is used at the next tick (records.py).
  They give the peer's swarm size, the phase to adopt and the cells to settle against.
- DHT cost (messages and bytes per peer): a node search asks all N - 1 peers up to BEAM + 1 peers
  (the peers' beam, bootstrap.DHT_BUCKET_SIZE; no early stop), beyond that BEAM + ALPHA x log2(N / BEAM); each reply
  lists up to BEAM peers. A store is a node search plus a store to each of REPLICAS replicas; a
  read is the same search, in which the replicas reply with the whole value (N records for the
  progress key). Per round: one declare and MATCHMAKING_READS reads of the group key, one verdict
  store and VERDICT_READS reads; per minute: two config records. A peer also serves as many
  requests as it makes, so its DHT moves twice what its own requests do (BOTH_ENDS).
- Anchors: vectors of ANCHOR_DIMS values, all equal at the start. An inner step moves the local
  weights by lr x (the common direction + --noise x a peer's own unit-norm noise), with the inner lr of
  diloco.inner_lr_at (cosine over --total-steps). A group's members leave with the mean of their
  anchors minus the mean pseudo-gradient (weighted by steps, as tokens weigh the real ones; outer
  SGD, lr 1). Spread: mean distance of the live anchors to their mean, in units of one
  pseudo-gradient's noise at the peak lr (inner_lr x noise x sqrt(H)).
- Mixing: from a round R0 on, each applied group's members hold the union of what they held and
  every member's work; the mixing time is the rounds until every live anchor holds the work of every
  peer that was live at R0 (on a full grid: its dimensions, ceil(log_g N)).

Columns: group size mean and max over every member's applied rounds, and the share of them that held
a full line (`full`: N up to the target, else the longest of grid.sides); failed (formed, not applied)
and alone ("no group") shares of entries; `whole`: the share that held every used cell of the member's
line (grid.line_size, scale.py's line_whole_share), and `2nd` the same over the second half; applied
rounds per minute per peer; DHT per peer per applied round and per minute (medians); spread (median,
first and second half); mixing rounds (median, and how many measurements) against ceil(log_g N); the
wall seconds the simulation took.

Speed: N = 1,024 takes about 50 s here for 60 rounds, mostly grid.settle and Clock.adopt at the
progress reads. Clock.adopt's swarm_phase is O(records^2), 0.3 s a call at 1,024 records: past
--phase-sample records it gets a random sample of them (16, 32 or 64 gave the same results within the
spread between seeds, at 64 peers). N = 4,096 takes about a minute for 15 rounds: not a default.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2pdiloco import bootstrap, diloco, grid, schedule, swarm  # noqa: E402

# --- scale.py swarm's peers: peers/tiny-cpu.toml with --inner-steps 30, paced by --slowdown
UNPACED_STEPS_PER_S = 28.0  # a tiny peer's inner steps/s on the 2-core test machine; --slowdown S gives / S
DEFAULT_SLOWDOWN = 12.0     # runs/sw-new1's pacing: 2.3 steps/s, a round every ~13 s at H = 30
TINY_MODEL_MB = 0.24        # the tiny preset's ~120k parameters in fp16
TINY_TARGET_GROUP = 8       # the tiny preset's target_group_size (older result.json files do not say it)

# --- a round (hivemind's matchmaking and butterfly all-reduce, averaging.py's verdicts)
ROUND_RTTS = 3              # the leader's "begin", reduce-scatter, all-gather: then the verdicts go out
VERDICT_RTTS = 1            # the members' verdicts: one store and a read that finds them all
STATE_BYTES_PER_PARAM = 8   # a joiner's download: anchor and outer momentum in fp32 (state.py)

# --- the DHT (hivemind 1.1.12's DHTNode as bootstrap.py starts it: no cache, its beam and copies)
BEAM = bootstrap.DHT_BUCKET_SIZE   # bucket_size: a search keeps the BEAM nearest peers it heard of and asks each
ALPHA = 3                   # past the beam, each halving of the distance (log2(N / BEAM) of them) asks ~3 more
REPLICAS = bootstrap.DHT_REPLICAS  # num_replicas: a store goes to the nearest; in a read, each of them replies
RPC_BYTES = 250             # one request or reply without its payload: libp2p framing, protobuf, DHT ids
NODE_BYTES = 60             # one peer in a search's reply (DHT id and peer id)
GROUP_ENTRY_BYTES = 60      # one declared averager under the group key (peer id, expiration)
VERDICT_BYTES = 60          # one member's verdict under the round's key
CONFIG_BYTES = 100          # swarm.announce_config's records: two, every CONFIG_EVERY s
CONFIG_EVERY = 60.0
MATCHMAKING_READS = 2       # reads of the group key while looking for a leader
VERDICT_READS = 3           # averaging._gather reads again at 20, 30, 45 ms...: members finish within ~50 ms
BOTH_ENDS = 2               # every request has a server: per peer, the DHT moves twice its own requests

# --- measurement
ANCHOR_DIMS = 64            # values per anchor in the noise model
SAMPLE_EVERY = 5.0          # seconds between samples of the spread (scale.py's anchor_spread: 5 s)
MIX_GIVE_UP = 30            # rounds after which a mixing measurement that never completed counts as "never"
WARMUP_ROUNDS = 3           # periods before the first mixing measurement starts (the swarm finds its phase)


@dataclass
class Settings:
    """One simulated swarm. The defaults are scale.py swarm's tiny peers at --slowdown 12."""

    peers: int = 16                  # N founders
    target_group_size: int = TINY_TARGET_GROUP  # lines of the grid hold at most this many
    grid: bool = True                # cfg.grid: past target_group_size live peers, groups are lines of a grid
    inner_steps: int = 30            # H
    steps_per_s: float = UNPACED_STEPS_PER_S / DEFAULT_SLOWDOWN  # the median peer's inner steps per second
    speed_spread: float = 0.1        # sigma of the lognormal spread of the peers' speeds
    window: float = 2.0              # matchmaking_time
    min_group_size: int = 2
    log_interval: float = 2.0        # the preset's: progress records every max(1, N/8) log intervals
    rounds: int = 60                 # simulated time: this many periods of a median peer (unless duration)
    duration: float = 0.0            # simulated seconds (0: from rounds)
    start_spread: float = 1.0        # founders start training within this many seconds of each other
    model_mb: float = TINY_MODEL_MB  # fp16 size of the model: 2 bytes per parameter
    bandwidth_mbit: float = 100.0    # each peer's link, both ways
    rtt_ms: float = 20.0
    verdict_timeout: float = 4.0     # a member's verdict missing: the others give up after this
    kill_every: float = 0.0          # mean seconds between deaths (0: none)
    join_every: float = 0.0          # mean seconds between joins (0: none)
    record_bytes: int = 600          # one progress record (clock, cell, multiaddrs, counters)
    inner_lr: float = 3e-3
    warmup_steps: int = 50
    total_steps: int = 20000         # the cosine's length in swarm position (outer_step x H + local steps)
    min_lr_ratio: float = 0.1
    noise: float = 1.0               # per-step noise against the common direction's 1
    outer_lr: float = 1.0
    phase_sample: int = 32           # records given to Clock.adopt at most (its cost is quadratic)
    progress_every: float = 0.0      # what-if: store and read the records this often (0: swarm.progress_read_every)
    seed: int = 0

    @property
    def period(self) -> float:
        return self.inner_steps / self.steps_per_s

    @property
    def sim_seconds(self) -> float:
        return self.duration or self.rounds * self.period


# ---------------------------------------------------------------------------------------- the DHT

def contacts(n: int) -> int:
    """Peers one node search asks in a swarm of n: everyone up to BEAM + 1 peers (hivemind searches
    without an early stop); beyond, the BEAM nearest (a search ends when they are all asked) plus
    ALPHA per hop of the log2(n / BEAM) it takes to get near them."""
    if n - 1 <= BEAM:
        return max(0, n - 1)
    return BEAM + math.ceil(ALPHA * math.log2(n / BEAM))


def search(n: int) -> tuple[int, int]:
    """(messages, bytes) of one node search: a request and a reply listing up to BEAM peers, per peer asked."""
    c = contacts(n)
    return 2 * c, c * (2 * RPC_BYTES + NODE_BYTES * min(BEAM, n - 1))


def store_cost(n: int, value: int) -> tuple[int, int]:
    """A store: the search for the key's nearest peers, then the value to each replica."""
    msgs, size = search(n)
    r = min(REPLICAS, n - 1)
    return msgs + 2 * r, size + r * (2 * RPC_BYTES + value)


def read_cost(n: int, value: int) -> tuple[int, int]:
    """A read (latest=True searches on to the end): the same search, each replica's reply with the value."""
    msgs, size = search(n)
    return msgs, size + min(REPLICAS, n - 1) * value


# ------------------------------------------------------------------------------------ the swarm

@dataclass(eq=False)
class Peer:
    """One simulated peer: its speed, its real Clock and grid cell, its anchor and counters."""

    id: str
    bit: int                         # its bit in the mixing sets
    speed: float                     # inner steps per second
    anchor: np.ndarray               # never changed in place: members of a group share the new one
    outer_step: int = 0
    t0: float = 0.0                  # inner step k ends at t0 + k / speed
    clock: Optional[schedule.Clock] = None
    coords: Optional[list] = None    # outer.grid_coords
    known: list = field(default_factory=list)  # the peer ids of the last progress records read (outer.known_peers)
    swarm_size: int = 1
    alive: bool = True
    pending: Optional["Group"] = None  # the round in flight
    entry: Optional["Entry"] = None
    count_from: int = 0              # without a schedule, enter inner_steps steps after this step
    progress: Optional[np.ndarray] = None  # local weights - anchor
    progress_steps: int = 0
    accrued: int = 0                 # the step up to which progress is counted
    mix: int = 0
    wake_token: int = 0
    published_at: float = -math.inf
    read_at: float = -math.inf
    announced_at: float = -math.inf
    reading: Optional[dict] = None   # records of a read that came back, used at the next tick
    applied: int = 0
    failed: int = 0
    alone: int = 0
    msgs: int = 0
    bytes: int = 0

    def step_at(self, t: float) -> int:      # t is a step's end
        return round((t - self.t0) * self.speed)

    def step_after(self, t: float) -> int:   # the first step that ends at or after t
        return math.ceil((t - self.t0) * self.speed - 1e-9)

    def time_of(self, k: int) -> float:
        return self.t0 + k / self.speed


@dataclass(eq=False)
class Entry:
    """A peer's entry into matchmaking: its gather, the line it entered and its contribution."""

    peer: Peer
    gather: dict                     # Clock.announce: due, speed, round, dims
    line: Optional[tuple]            # (round, dims, coords): outer._enter_line
    delta: np.ndarray                # pseudo-gradient: the progress since its anchor
    steps: int


@dataclass(eq=False)
class Group:
    """A matchmaking group, open until it forms (or its leader's window ends), then a round."""

    key: str
    goal: int                        # the leader's target group size
    done_at: float                   # the window's end; once formed, when the round ends
    entries: list = field(default_factory=list)
    formed_at: Optional[float] = None
    verdict_at: float = math.inf     # members publish their verdicts: a death before fails the round
    failed: bool = False
    round: int = 0
    anchor: Optional[np.ndarray] = None
    outer_step: int = 0
    mix: int = 0                     # Mixing: the union of what the members hold
    tag: int = -1                    # ... for this measurement


class Mixing:
    """Rounds until every live anchor holds a share of every peer's work, measured again and again.
    From round r0 on, an applied group's members hold the union of what each held and each one's bit;
    done when every live peer holds the bits of every peer live at the start (and still alive)."""

    def __init__(self):
        self.tag, self.active, self.r0, self.need, self.last = 0, False, 0, 0, 0
        self.incomplete: Optional[set] = None
        self.results: list = []      # rounds, or None: not done within MIX_GIVE_UP

    def start(self, live: list) -> None:
        self.tag += 1
        self.active, self.incomplete = True, None
        self.r0 = max(p.clock.round for p in live) + 1  # after every round in flight
        self.last = self.r0
        self.need = 0
        for p in live:
            p.mix = 0
            self.need |= p.bit

    def union(self, group: Group) -> None:
        if not self.active:
            return
        group.tag, group.mix = self.tag, 0
        for e in group.entries:
            group.mix |= e.peer.mix | (e.peer.bit if group.round >= self.r0 else 0)

    def landed(self, p: Peer, group: Group, live: list) -> None:
        if not self.active or group.tag != self.tag:
            return
        p.mix = group.mix
        self.last = max(self.last, group.round)
        if group.round - self.r0 + 1 > MIX_GIVE_UP:
            self._finish(None)
        elif group.round >= self.r0 and group.mix & self.need == self.need:
            if self.incomplete is None:  # the first complete group: who is not there yet
                self.incomplete = {q for q in live if q.mix & self.need != self.need}
            self.incomplete.discard(p)
            if not self.incomplete:
                self._finish(group.round - self.r0 + 1)

    def joined(self, p: Peer, source: Optional[Peer]) -> None:
        p.mix = source.mix if source is not None and self.active else 0
        if self.incomplete is not None and p.mix & self.need != self.need:
            self.incomplete.add(p)

    def killed(self, p: Peer) -> None:
        self.need &= ~p.bit
        if self.incomplete is not None:
            self.incomplete = {q for q in self.incomplete if q is not p and q.mix & self.need != self.need}
            if not self.incomplete:  # the last one missing was the one that died
                self._finish(self.last - self.r0 + 1)

    def _finish(self, rounds: Optional[int]) -> None:
        self.results.append(rounds)
        self.active = False


class Sim:
    """The event loop and what the peers do at each event (mirroring outer.py and peer.py)."""

    def __init__(self, s: Settings):
        self.s = s
        self.rng = random.Random(s.seed)
        self.gen = np.random.default_rng(s.seed)
        self.cfg = SimpleNamespace(log_interval=s.log_interval)  # all progress_read_every reads
        self.heap: list = []
        self.seq = itertools.count()
        self.records: dict = {}      # the progress key: peer id -> (record, expires at)
        self.buckets: dict = {}      # group key bits -> the open group
        self.live: list = []
        self.peers: list = []
        self.sizes: list = []        # group size, once per member per applied round (each peer's "outer" event)
        self.whole: list = []        # ... (t, whether it held every used cell of the member's line: scale.py's)
        self.spread: list = []       # (t, spread)
        self.mixing = Mixing()
        self.events = 0
        direction = self.gen.standard_normal(ANCHOR_DIMS)
        self.direction = direction / np.linalg.norm(direction)
        self.unit = s.inner_lr * s.noise * math.sqrt(s.inner_steps)
        self.model_bytes = s.model_mb * 1e6
        self.rtt = s.rtt_ms / 1e3

    # -- the loop

    def push(self, t: float, handler, *args) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), handler, args))

    def run(self) -> dict:
        s = self.s
        for _ in range(s.peers):
            p = self.new_peer(np.zeros(ANCHOR_DIMS))
            # scale.py's founders wait for each other (--wait-for-peers), having published a record without a clock
            self.records[p.id] = ({"outer_step": 0}, max(15.0, 3 * s.log_interval))
            self.push(self.rng.uniform(0, s.start_spread), self.begin, p)
        if s.kill_every:
            self.push(self.rng.expovariate(1 / s.kill_every), self.kill)
        if s.join_every:
            self.push(self.rng.expovariate(1 / s.join_every), self.join)
        self.push(SAMPLE_EVERY, self.sample)
        end = s.sim_seconds
        while self.heap and self.heap[0][0] <= end:
            t, _, handler, args = heapq.heappop(self.heap)
            self.events += 1
            handler(t, *args)
        return self.metrics(end)

    def new_peer(self, anchor: np.ndarray) -> Peer:
        speed = self.s.steps_per_s * math.exp(self.s.speed_spread * self.gen.standard_normal())
        p = Peer(id=f"Qm{self.rng.getrandbits(64):016x}", bit=1 << len(self.peers), speed=speed, anchor=anchor,
                 progress=np.zeros(ANCHOR_DIMS))
        self.peers.append(p)
        return p

    def charge(self, p: Peer, cost: tuple[int, int], times: int = 1) -> None:
        p.msgs += BOTH_ENDS * times * cost[0]
        p.bytes += BOTH_ENDS * times * cost[1]

    # -- a peer's life: outer.Rounds.begin, its log ticks, its rounds

    def begin(self, t: float, p: Peer) -> None:
        """outer.Rounds.begin: a Clock, then (initial_peers) a blocking read of the progress records."""
        s = self.s
        p.t0 = t
        p.clock = schedule.Clock(inner_steps=s.inner_steps, now=t, inner_step=0, window=s.window,
                                 group_size=s.target_group_size if s.grid else 0)
        self.live.append(p)
        records = self.snapshot(t)
        self.charge(p, read_cost(len(self.live), len(records) * s.record_bytes))
        self.note_progress(p, records, t)
        self.push(t + s.log_interval, self.tick, p, 1)

    def tick(self, t: float, p: Peer, j: int) -> None:
        """peer._log_inner every log interval: our record, then records.py reads the others."""
        if not p.alive:
            return
        s, n = self.s, len(self.live)
        every = self.progress_every(p, t)
        if t - p.published_at >= 0.9 * every:
            record = {"outer_step": p.outer_step, "time": t, **p.clock.record(),
                      **({"cell": list(p.coords)} if p.coords is not None else {})}
            self.records[p.id] = (record, t + max(15.0, 3 * every))
            p.published_at = t
            self.charge(p, store_cost(n, s.record_bytes))
        if t - p.announced_at >= CONFIG_EVERY:
            p.announced_at = t
            self.charge(p, store_cost(n, CONFIG_BYTES), times=2)
        if p.reading is not None:
            records, p.reading = p.reading, None
            self.note_progress(p, records, t)
        every = self.progress_every(p, t)
        if t - p.read_at >= 0.9 * every:
            p.read_at, p.reading = t, self.snapshot(t)
            self.charge(p, read_cost(n, len(p.reading) * s.record_bytes))
        # the next tick with something to do (the ticks in between do nothing here)
        nxt = t + s.log_interval if p.reading is not None else min(
            p.published_at + 0.9 * every, p.read_at + 0.9 * every, p.announced_at + CONFIG_EVERY)
        j = max(j + 1, math.ceil((nxt - p.t0) / s.log_interval - 1e-9))
        self.push(p.t0 + j * s.log_interval, self.tick, p, j)

    def progress_every(self, p: Peer, t: float) -> float:
        """Seconds between our stores of our record, and between our reads of everyone's."""
        return self.s.progress_every or swarm.progress_read_every(self.cfg, p.swarm_size, age=t - p.t0)

    def snapshot(self, t: float) -> dict:
        """The live records (peer id -> record), as a read of the progress key returns them."""
        out, expired = {}, []
        for peer_id, (record, expires) in self.records.items():
            if expires > t:
                out[peer_id] = record
            else:
                expired.append(peer_id)
        for peer_id in expired:
            del self.records[peer_id]
        return out

    def note_progress(self, p: Peer, records: dict, t: float) -> None:
        """outer._note_progress: our swarm size, the swarm's phase if we may be out of it, our cell."""
        s = self.s
        p.swarm_size = len(records.keys() | {p.id})
        p.known = list(records)
        p.clock.observe(records)
        if not p.clock.in_phase:
            if len(records) > s.phase_sample:  # swarm_phase is quadratic in the records (module docstring)
                records_for_phase = {k: records[k] for k in self.rng.sample(list(records), s.phase_sample)}
            else:
                records_for_phase = records
            p.clock.adopt(records_for_phase, now=t)
        if s.grid and p.clock.dims > 1:  # outer._settle_cell
            size, dims = s.target_group_size, p.clock.dims
            cells = grid.cells_of(records, me=p.id, round_=p.clock.round, dims=dims, size=size)
            coords = grid.fit(p.coords or [], dims, size, p.id, p.known)
            p.coords = grid.settle(p.id, coords, cells, live=p.swarm_size, dims=dims, size=size, salt=p.clock.round)
        if p.pending is None:  # the clock may have moved: when do we enter next?
            self.schedule_wake(p, t)

    def schedule_wake(self, p: Peer, t: float) -> None:
        """The step at which should_enter will say yes: the due time's (half a step early), or H
        steps after the last entry without a schedule. Wakes scheduled before are void."""
        k = p.step_after(t)
        if p.clock.due is None:
            k = max(k, p.count_from + self.s.inner_steps)
        else:
            k = max(k, math.ceil((p.clock.due - 0.5 / p.speed - p.t0) * p.speed - 1e-9))
        p.wake_token += 1
        self.push(p.time_of(k), self.wake, p, p.wake_token)

    def wake(self, t: float, p: Peer, token: int) -> None:
        """outer.Rounds.at_step_boundary, at the step it would enter: asks the real clock."""
        if token != p.wake_token or not p.alive or p.pending is not None:
            return
        k = p.step_at(t)
        enter = p.clock.should_enter(now=t, inner_step=k)
        if enter is None:  # no schedule (yet): every inner_steps steps
            enter = k - p.count_from >= self.s.inner_steps
        if enter:
            self.enter(p, t, k)
        else:
            self.schedule_wake(p, p.time_of(k + 1))

    def accrue(self, p: Peer, k: int) -> None:
        """The local progress of the steps since the last count, at the inner lr of this position."""
        s, steps = self.s, k - p.accrued
        if steps <= 0:
            return
        lr = diloco.inner_lr_at(p.outer_step * s.inner_steps + (k - p.count_from), inner_lr=s.inner_lr,
                                warmup_steps=s.warmup_steps, total_steps=s.total_steps, min_lr_ratio=s.min_lr_ratio)
        noise = self.gen.standard_normal(ANCHOR_DIMS) / math.sqrt(ANCHOR_DIMS)
        p.progress = p.progress + lr * (steps * self.direction + math.sqrt(steps) * s.noise * noise)
        p.progress_steps += steps
        p.accrued = k

    def enter(self, p: Peer, t: float, k: int) -> None:
        """outer._start_round: point at our line of the grid, announce, set the target, meet."""
        s = self.s
        self.accrue(p, k)
        bits, line = "", None
        if s.grid:  # outer._enter_line
            size, dims = s.target_group_size, p.clock.dims
            p.coords = coords = grid.fit(p.coords or [], dims, size, p.id, p.known)
            bits = grid.key_bits(coords, round_=p.clock.round, dims=dims, size=size)
            line = (p.clock.round, dims, coords)
        gather = p.clock.announce(now=t, inner_step=k, swarm_size=p.swarm_size)
        live = self.full_group(p)  # full_groups: every live peer, or our whole line, is expected
        goal = live if live >= max(2, s.min_group_size) else s.target_group_size
        p.count_from = k
        p.entry = Entry(p, gather, line, p.progress, p.progress_steps)
        n = len(self.live)
        self.charge(p, store_cost(n, GROUP_ENTRY_BYTES))
        self.charge(p, read_cost(n, goal * GROUP_ENTRY_BYTES), times=MATCHMAKING_READS)
        group = self.buckets.get(bits)
        if group is None:  # we lead
            group = self.buckets[bits] = Group(bits, goal, t + s.window)
            self.push(t + s.window, self.window_end, group)
        group.entries.append(p.entry)
        p.pending = group
        if len(group.entries) >= group.goal:
            self.form(group, t)

    def full_group(self, p: Peer) -> int:
        """outer._full_group: every live peer up to target_group_size, or with a grid a whole line."""
        s = self.s
        if s.grid and p.clock.dims > 1:
            return grid.line_size(p.coords, round_=p.clock.round, dims=p.clock.dims, size=s.target_group_size,
                                  live=p.swarm_size)
        return min(s.target_group_size, p.swarm_size)

    def line_need(self, entry: Entry) -> int:
        """The members a whole group of this entry's line holds, as scale.py's line_whole_share counts them:
        the used cells of its line on a grid of the live peers (with one dimension, everyone up to the target)."""
        live, size = len(self.live), self.s.target_group_size
        if entry.line is None or entry.line[1] <= 1:
            return min(live, size)
        round_, dims, coords = entry.line
        return grid.line_size(coords, round_=round_, dims=dims, size=size, live=live)

    def window_end(self, t: float, group: Group) -> None:
        if group.formed_at is not None:
            return
        if self.buckets.get(group.key) is group:  # also when deaths emptied it: later entrants lead anew
            del self.buckets[group.key]
        if not group.entries:
            return
        if len(group.entries) >= self.s.min_group_size:
            self.form(group, t)
        else:  # "no group", seen at the next step
            p = group.entries[0].peer
            self.push(p.time_of(p.step_after(t)), self.land, p, group)

    def form(self, group: Group, t: float) -> None:
        """The group formed: the round's times, and the members' next anchor (merge, then outer step)."""
        s, entries = self.s, group.entries
        if self.buckets.get(group.key) is group:
            del self.buckets[group.key]
        g = len(entries)
        group.formed_at = t
        transfer = 2 * (g - 1) / g * self.model_bytes * 8 / (s.bandwidth_mbit * 1e6)
        group.verdict_at = t + ROUND_RTTS * self.rtt + transfer
        group.done_at = group.verdict_at + VERDICT_RTTS * self.rtt
        group.round = statistics.median_low(e.gather["round"] for e in entries)
        weights = np.array([e.steps for e in entries], dtype=float)
        deltas = np.stack([e.delta for e in entries])
        average = weights @ deltas / weights.sum() if weights.sum() > 0 else np.zeros(ANCHOR_DIMS)
        merged = np.mean([e.peer.anchor for e in entries], axis=0)
        group.anchor = merged - s.outer_lr * average
        group.outer_step = max(e.peer.outer_step for e in entries) + 1
        self.mixing.union(group)
        n = len(self.live)
        for e in entries:
            self.charge(e.peer, store_cost(n, VERDICT_BYTES))
            self.charge(e.peer, read_cost(n, g * VERDICT_BYTES), times=VERDICT_READS)
            self.push(e.peer.time_of(e.peer.step_after(group.done_at)), self.land, e.peer, group)

    def land(self, t: float, p: Peer, group: Group) -> None:
        """outer.Rounds._land_round at the first step after the round ended: the clock, our cell, the anchor."""
        if not p.alive or p.pending is not group or t + 1e-9 < group.done_at:
            return  # dead, or a failed round moved its end (a new event is queued)
        s, entry = self.s, p.entry
        p.pending = p.entry = None
        if group.formed_at is None:
            p.clock.after_no_group()
            p.alone += 1
        else:
            if entry.line is not None:  # outer._leave_line: the cells the members entered with, from the gather
                round_, dims, coords = entry.line
                cells = {e.peer.id: list(e.line[2]) if e.line is not None else None for e in group.entries}
                p.coords = grid.reindex(coords, round_=round_, dims=dims, size=s.target_group_size, me=p.id,
                                        cells=cells)
            # Rounds._land_round: only a group of every live peer leaves everyone in phase (not one line of a grid)
            whole = p.clock.dims <= 1 and len(group.entries) >= p.swarm_size
            p.clock.after_round([e.gather for e in group.entries], full=whole, now=t)
            p.count_from = math.floor((group.formed_at - p.t0) * p.speed + 1e-9)  # _count_from_formation
            if group.failed:
                p.failed += 1
            else:
                p.anchor, p.outer_step = group.anchor, group.outer_step
                p.progress = p.progress - entry.delta
                p.progress_steps -= entry.steps
                p.applied += 1
                self.sizes.append(len(group.entries))
                self.whole.append((t, len(group.entries) >= self.line_need(entry)))
                self.mixing.landed(p, group, self.live)
        self.schedule_wake(p, t)

    # -- churn, and the samples

    def kill(self, t: float) -> None:
        if len(self.live) > 1:
            p = self.rng.choice(self.live)
            p.alive = False
            self.live.remove(p)
            self.mixing.killed(p)
            group = p.pending
            if group is not None and group.formed_at is None:
                group.entries.remove(p.entry)
            elif group is not None and not group.failed and t < group.verdict_at:
                # averaging.py: no verdict from it, so the others discard the round after verdict_timeout
                group.failed = True
                group.done_at = group.verdict_at + self.s.verdict_timeout
                for e in group.entries:
                    if e.peer.alive:
                        self.push(e.peer.time_of(e.peer.step_after(group.done_at)), self.land, e.peer, group)
        self.push(t + self.rng.expovariate(1 / self.s.kill_every), self.kill)

    def join(self, t: float) -> None:
        p = self.new_peer(np.zeros(ANCHOR_DIMS))
        download = STATE_BYTES_PER_PARAM * self.model_bytes / 2 * 8 / (self.s.bandwidth_mbit * 1e6) + 2 * self.rtt
        self.push(t + download, self.joined, p)
        self.push(t + self.rng.expovariate(1 / self.s.join_every), self.join)

    def joined(self, t: float, p: Peer) -> None:
        """The state came from one live peer: its anchor and outer step (and so its share of everyone's work)."""
        source = self.rng.choice(self.live) if self.live else None
        if source is not None:
            p.anchor, p.outer_step = source.anchor, source.outer_step
        self.mixing.joined(p, source)
        self.begin(t, p)

    def sample(self, t: float) -> None:
        if len(self.live) >= 2:
            anchors = np.stack([p.anchor for p in self.live])
            distance = np.linalg.norm(anchors - anchors.mean(0), axis=1).mean()
            self.spread.append((t, float(distance / self.unit)))
        if not self.mixing.active and self.live and t >= WARMUP_ROUNDS * self.s.period:
            self.mixing.start(self.live)
        self.push(t + SAMPLE_EVERY, self.sample)

    # -- the row

    def metrics(self, end: float) -> dict:
        s = self.s
        n = s.peers
        dims = grid.dims_for(n, s.target_group_size) if s.grid else 1
        line = n if n <= s.target_group_size else max(grid.sides(n, dims, s.target_group_size))  # as scale.py
        minutes = {p: (end - p.t0) / 60 for p in self.live if end > p.t0}
        per_round = [p for p in minutes if p.applied]
        formed = sum(p.applied + p.failed for p in self.peers)
        entries = formed + sum(p.alone for p in self.peers)
        mixed = [r for r in self.mixing.results if r is not None]
        late = [(t, w) for t, w in self.whole if t >= end / 2]

        def median(values):
            values = list(values)
            return statistics.median(values) if values else None

        return {
            "peers": n, "target_group_size": s.target_group_size, "grid": s.grid, "dims": dims, "line": line,
            "steps_per_s": s.steps_per_s, "sim_s": end,
            "group_size_mean": statistics.mean(self.sizes) if self.sizes else None,
            "group_size_max": max(self.sizes, default=None),
            "full_share": sum(g >= line for g in self.sizes) / len(self.sizes) if self.sizes else None,
            "line_whole_share": statistics.mean(w for _, w in self.whole) if self.whole else None,
            # the same from half the simulated time on: past the start, when the records are up to N/8 log intervals old
            "line_whole_second_half": statistics.mean(w for t, w in late) if late else None,
            "failed_share": sum(p.failed for p in self.peers) / formed if formed else None,
            "alone_share": sum(p.alone for p in self.peers) / entries if entries else None,
            "rounds_per_min_median": median(p.applied / m for p, m in minutes.items()),
            "dht_msgs_per_peer_round": median(p.msgs / p.applied for p in per_round),
            "dht_kb_per_peer_round": median(p.bytes / p.applied / 1e3 for p in per_round),
            "dht_msgs_per_peer_min": median(p.msgs / m for p, m in minutes.items()),
            "dht_kb_per_peer_min": median(p.bytes / m / 1e3 for p, m in minutes.items()),
            "spread_median": median(v for _, v in self.spread),
            "spread_first_half": _half(self.spread, 0), "spread_second_half": _half(self.spread, 1),
            "mixing_rounds_median": median(mixed), "mixing_measured": len(mixed),
            "mixing_never": len(self.mixing.results) - len(mixed),
            "log_g_n": math.ceil(math.log(n) / math.log(s.target_group_size) - 1e-9) if n > 1 else 0,
            "events": self.events,
        }


def _half(series: list, which: int) -> Optional[float]:
    """Median of the first or second half of a (t, value) series (scale.py's)."""
    half = len(series) // 2
    part = series[:half] if which == 0 else series[half:]
    return statistics.median(v for _, v in part) if part else None


def simulate(settings: Settings) -> dict:
    """One swarm: the row of metrics, with the wall seconds the simulation took."""
    t0 = time.perf_counter()
    row = Sim(settings).run()
    row["wall_s"] = time.perf_counter() - t0
    return row


# ------------------------------------------------------------------------------------ reports

def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


HEADER = (f"{'peers':>5} {'group':>5} {'dims':>4} {'line':>4} {'mean':>5} {'max':>4} {'full':>5} {'failed':>6} "
          f"{'alone':>5} {'whole':>5} {'2nd':>5} {'rnd/min':>7} {'DHT msg/rnd':>11} {'kB/rnd':>7} {'msg/min':>7} "
          f"{'kB/min':>7} "
          f"{'spread':>7} {'1st':>6} {'2nd':>6} {'mix':>4} {'(n)':>4} {'logN':>4} {'wall s':>6}")


def row_line(r: dict) -> str:
    return (f"{r['peers']:>5} {r['target_group_size']:>5} {r['dims']:>4} {r['line']:>4} "
            f"{_num(r['group_size_mean'], 2):>5} {_num(r['group_size_max'], 0):>4} {_num(r['full_share'], 2):>5} "
            f"{_num(r['failed_share'], 3):>6} {_num(r['alone_share'], 3):>5} {_num(r.get('line_whole_share'), 2):>5} "
            f"{_num(r.get('line_whole_second_half'), 2):>5} "
            f"{_num(r['rounds_per_min_median'], 2):>7} {_num(r['dht_msgs_per_peer_round'], 0):>11} "
            f"{_num(r['dht_kb_per_peer_round'], 1):>7} {_num(r['dht_msgs_per_peer_min'], 0):>7} "
            f"{_num(r['dht_kb_per_peer_min'], 0):>7} {_num(r['spread_median'], 3):>7} "
            f"{_num(r['spread_first_half'], 3):>6} {_num(r['spread_second_half'], 3):>6} "
            f"{_num(r['mixing_rounds_median'], 1):>4} {r['mixing_measured']:>4} {r['log_g_n']:>4} "
            f"{r['wall_s']:>6.1f}")


def compare(path: Path, base: Settings, steps_per_s: Optional[float]) -> list[dict]:
    """Simulate each swarm of a `scale.py swarm` result.json (its peers, target group, pacing and
    duration; H = 30, a 2 s window, the tiny preset's log interval) and put the prediction next to
    what was measured: group size and applied rounds per minute, their ratio, within 20% or not.
    The peers' step rate is an input, not a prediction: `steps_per_s` if given, else the run's own
    (the median peer's inner steps per second, which scale.py records), else the tiny preset's
    unpaced rate on this machine over the run's slowdown ("nominal"; on 2 busy cores the real rate
    is 0.6-1.4x that)."""
    rows = []
    for measured in json.loads(Path(path).read_text()):
        if not isinstance(measured, dict) or "peers" not in measured:
            continue
        own = measured.get("steps_per_s_median")
        rate = steps_per_s or own or UNPACED_STEPS_PER_S / float(measured.get("slowdown") or 1.0)
        source = "flag" if steps_per_s else "run" if own else "nominal"
        target = int(measured.get("target_group_size") or TINY_TARGET_GROUP)
        settings = replace(base, peers=int(measured["peers"]), target_group_size=target,
                           grid=bool(measured.get("grid", True)), inner_steps=30, window=2.0, log_interval=2.0,
                           steps_per_s=rate, duration=float(measured.get("duration_s") or 0.0))
        predicted = simulate(settings)
        row = {"peers": settings.peers, "target_group_size": settings.target_group_size, "steps_per_s": rate,
               "steps_per_s_from": source}
        for key in ("group_size_mean", "rounds_per_min_median"):
            p, m = predicted[key], measured.get(key)
            ratio = p / m if p is not None and m else None
            row[key] = {"predicted": p, "measured": m, "ratio": ratio,
                        "within_20pct": ratio is not None and abs(ratio - 1) <= 0.2}
        row["predicted"] = predicted
        rows.append(row)
    print(f"{'peers':>5} {'group':>5} {'steps/s':>7} {'from':>7}   {'group size: sim':>15} {'real':>5} {'ratio':>5} "
          f"{'<20%':>4}   {'rounds/min: sim':>15} {'real':>5} {'ratio':>5} {'<20%':>4}")
    for r in rows:
        g, m = r["group_size_mean"], r["rounds_per_min_median"]
        print(f"{r['peers']:>5} {r['target_group_size']:>5} {r['steps_per_s']:>7.2f} {r['steps_per_s_from']:>7}   "
              f"{_num(g['predicted'], 2):>15} {_num(g['measured'], 2):>5} {_num(g['ratio'], 2):>5} "
              f"{'yes' if g['within_20pct'] else 'no':>4}   {_num(m['predicted'], 2):>15} {_num(m['measured'], 2):>5} "
              f"{_num(m['ratio'], 2):>5} {'yes' if m['within_20pct'] else 'no':>4}")
    return rows


# flag -> the Settings field it sets, and its help (the default is the field's)
FLAGS = [
    ("--target-group", "target_group_size", "target_group_size: the grid's lines hold at most this many"),
    ("--inner-steps", "inner_steps", "H"),
    ("--speed-spread", "speed_spread", "sigma of the peers' lognormal speeds"),
    ("--window", "window", "matchmaking window, s"),
    ("--log-interval", "log_interval", "s between a peer's log ticks (progress records every max(1, N/8) of them)"),
    ("--rounds", "rounds", "simulated time, in periods of a median peer"),
    ("--duration", "duration", "simulated seconds (overrides --rounds)"),
    ("--model-mb", "model_mb", "the model in fp16, MB"),
    ("--bandwidth-mbit", "bandwidth_mbit", "each peer's link"),
    ("--rtt-ms", "rtt_ms", "round-trip time between peers"),
    ("--kill-every", "kill_every", "mean seconds between deaths (0: none)"),
    ("--join-every", "join_every", "mean seconds between joins (0: none)"),
    ("--record-bytes", "record_bytes", "one progress record"),
    ("--total-steps", "total_steps", "the inner lr's cosine length"),
    ("--noise", "noise", "per-step noise, against the common direction's 1"),
    ("--phase-sample", "phase_sample", "records given to Clock.adopt at most"),
    ("--progress-every", "progress_every", "what-if: store and read the progress records every this many s "
                                           "whatever N (0: swarm.progress_read_every, as the real peers)"),
    ("--seed", "seed", ""),
]


def main(argv=None) -> int:
    d = Settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 1024], help="swarm sizes N")
    parser.add_argument("--no-grid", action="store_true", help="groups of whoever is ready, no rotating grid")
    parser.add_argument("--steps-per-s", type=float, default=None,
                        help=f"the median peer's inner steps/s (default {d.steps_per_s:.2f}; with --compare, "
                             f"{UNPACED_STEPS_PER_S:g} / the run's slowdown)")
    for flag, name, text in FLAGS:
        default = getattr(d, name)
        parser.add_argument(flag, dest=name, type=type(default), default=default, help=text or None)
    parser.add_argument("--json", default="", help="write the rows here")
    parser.add_argument("--compare", default="", help="a scale.py swarm result.json: predicted vs measured")
    args = parser.parse_args(argv)
    if args.target_group_size < 2 or args.inner_steps < 1 or args.window <= 0 or args.phase_sample < 2:
        parser.error("--target-group must be >= 2, --inner-steps >= 1, --window > 0, --phase-sample >= 2")
    if min(args.sizes) < 2 or (args.steps_per_s or 1) <= 0 or min(args.progress_every, args.duration) < 0:
        parser.error("--sizes must be >= 2 peers each, --steps-per-s > 0, --progress-every and --duration >= 0")
    base = replace(d, grid=not args.no_grid, steps_per_s=args.steps_per_s or d.steps_per_s,
                   **{name: getattr(args, name) for _, name, _ in FLAGS})
    if args.compare:
        rows = compare(Path(args.compare), base, args.steps_per_s)
    else:
        print(HEADER, flush=True)
        rows = []
        for n in args.sizes:  # a line as each size finishes: the big ones take a while
            rows.append(simulate(replace(base, peers=n)))
            print(row_line(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": asdict(base), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
