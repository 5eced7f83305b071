"""The all-reduce of one round, as this peer's averager process runs it.

hivemind's `AllReduceRunner`, extended so that a round can be judged all-or-nothing and a bad
contribution cannot spoil it (averaging.py runs the rounds and collects the verdicts):

- `ContributionPolicy`: how our reducer treats each sender's parts, decided from what every
  member announced when the group formed (norm, weight), the same on every member;
- `CountingAllReduceRunner`: checks each sender's parts against the policy while it reduces
  them, counts the bytes it sends and receives, and reports (`RoundReport`) the parts that never
  came back and the senders it excluded;
- `InPlaceParts`: each averaged part is written into its place in the round's buffer as it
  arrives, instead of queuing behind slower reducers' parts (docs/scale.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, BannedException
from hivemind.averaging.partition import TensorPartContainer, TensorPartReducer
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, attach_event_on_finished

from p2pdiloco import robust
from p2pdiloco.compression import BlockwiseQuantization

# Test-only: "lie:K" makes this peer's reducer answer -K times the true average of its parts (a
# malicious reducer), so that tests and bench.py byzantine can check that the others catch it.
TEST_ATTACK = os.environ.get("P2PDILOCO_TEST_ATTACK", "")


@dataclass
class RoundReport:
    """What one member saw of its own all-reduce, measured inside the averager process."""

    group_id: str
    complete: bool
    reason: str = ""
    bytes_sent: int = 0
    bytes_recv: int = 0
    rejected: dict = field(default_factory=dict)  # sender peer id -> why its parts were excluded
    merged: bool = False  # a merge round: anchors and outer momenta were averaged too
    clipped: dict = field(default_factory=dict)  # sender peer id -> mean factor our reducer scaled its
    # pseudo-gradient's deviation by (< 1), over the values it sent us
    merge_clipped: dict = field(default_factory=dict)  # the same for a merge round's anchor and momentum
    removed: float = 0.0  # the share of the senders' weight our reducer's clipping took off their pseudo-gradients
    layout: list = field(default_factory=list)   # (values, reducer index) of every part, in the buffer's order
    lost: list = field(default_factory=list)  # members that dropped out: senders our reducer dropped, reducers
    # whose parts never came back (peer ids); the schedule stops counting them until they publish again


@dataclass
class ContributionPolicy:
    """How our reducer treats each sender's parts, decided from what the members announced when the
    group formed (pseudo-gradient norm and weight; every member announces them in the gather).

    Excluded (weight 0): a part that is not finite or not of the expected shape and dtype; a
    sender that announced a non-finite norm or one over `max_norm_ratio` times the group's lower
    median; a part larger than its sender's announced norm allows. Weights are capped at
    `max_norm_ratio` times the median weight (`weight_ratio` with a robust rule: a sender that claims a
    large weight would otherwise pull a robust average with it). Every member derives the same policy, so every
    reducer treats a sender the same way and the round stays consistent.

    A merge round (`merge`: each sender's weight in the anchor average, diloco.merge_weights)
    sends [pseudo-gradient | anchor | momentum]; anchors and momenta pass the same rules, each
    against its own announced norm (`anchor_norm`, `momentum_norm`), and each sender scales them
    by `merge_scales` so that hivemind's one weight per sender yields the merge weights."""

    excluded: list        # per sender: True if none of its parts are used
    norm_caps: list       # per sender: the largest part norm consistent with its announcement
    weight_caps: list     # per sender: the largest weight it may claim
    notes: dict           # sender index -> reason
    segment_caps: Optional[list] = None   # merge rounds: per sender, caps of its 3 segments' norms
    merge_scales: Optional[list] = None   # merge rounds: per sender, the factor on its anchor and momentum
    merge_problem: str = ""               # merge rounds: why no anchor average is possible (the round fails)
    merge_votes: Optional[list] = None    # merge rounds: per sender, its weight in the anchor average
    weights: Optional[list] = None        # per sender: the weight it counts with (announced, capped; 0 if excluded)

    @classmethod
    def from_gathered(cls, gathered: list, *, max_norm_ratio: float, norm_slack: float = 1.01,
                      merge: Optional[list] = None, weight_ratio: Optional[float] = None) -> "ContributionPolicy":
        norms = [g.get("norm") if isinstance(g, dict) else None for g in gathered]
        weights = [g.get("weight") if isinstance(g, dict) else None for g in gathered]
        median = _lower_median([n for n in norms if isinstance(n, (int, float)) and math.isfinite(n) and n >= 0])
        median_w = _lower_median([w for w in weights if isinstance(w, (int, float)) and math.isfinite(w) and w > 0])
        notes = {}
        for i, n in enumerate(norms):
            if not isinstance(n, (int, float)) or not math.isfinite(n) or n < 0:
                notes[i] = f"announced pseudo-gradient norm {n!r}"
            elif median > 0 and n > max_norm_ratio * median:
                # far outside the group: excluded. Scaling it down keeps a wrong direction (fp16
                # transport even clamps such values), which measurably hurt the others' loss.
                notes[i] = f"norm {n:.3g} > {max_norm_ratio:g}x the group median {median:.3g}: excluded"
        excluded = [i in notes for i in range(len(norms))]
        # norm_slack: how much a lossy codec may grow a norm (the announced norm is before encoding)
        caps = [0.0 if out else n * max(1.01, norm_slack) + 1e-6 for out, n in zip(excluded, norms)]
        ratio = max_norm_ratio if weight_ratio is None else weight_ratio
        policy = cls(excluded, caps, [ratio * (median_w or 1.0)] * len(norms), notes)
        if merge is not None:
            policy._plan_merge(gathered, merge, weights, max_norm_ratio)
        policy.weights = [policy.weight(i, w) for i, w in enumerate(weights)]
        return policy

    def _plan_merge(self, gathered: list, merge: list, weights: list, max_norm_ratio: float) -> None:
        announced = {}
        for key in ("anchor_norm", "momentum_norm"):
            values = [g.get(key) if isinstance(g, dict) else None for g in gathered]
            ok = [isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values]
            median = _lower_median([v for v, good, m in zip(values, ok, merge) if good and m > 0])
            for i, (v, good) in enumerate(zip(values, ok)):
                if merge[i] <= 0 or i in self.notes:
                    continue
                if not good:
                    self.notes[i] = f"announced {key} {v!r}"
                elif median > 0 and v > max_norm_ratio * median:
                    self.notes[i] = f"{key} {v:.3g} > {max_norm_ratio:g}x the group median {median:.3g}: excluded"
            announced[key] = [v if good else 0.0 for v, good in zip(values, ok)]
        self.excluded = [i in self.notes for i in range(len(gathered))]
        used = [0.0 if out or not isinstance(w, (int, float)) or not math.isfinite(w) else min(float(w), cap)
                for out, w, cap in zip(self.excluded, weights, self.weight_caps)]
        votes = [0.0 if out else float(m) for out, m in zip(self.excluded, merge)]
        self.merge_votes = votes
        total_w, total_v = sum(used), sum(votes)
        if total_v <= 0 or total_w <= 0:
            self.merge_problem = "no usable member at the group's newest outer step to merge anchors from"
        # hivemind averages sum(w x) / sum(w): sending v/w * W/V * anchor yields sum(v anchor) / sum(v)
        self.merge_scales = [v / w * total_w / total_v if w > 0 and total_v > 0 else 0.0 for v, w in zip(votes, used)]
        self.segment_caps = [[0.0 if out else cap, *(scale * announced[key][i] * 1.01 + 1e-6
                                                     for key in ("anchor_norm", "momentum_norm"))]
                             for i, (out, cap, scale) in enumerate(zip(self.excluded, self.norm_caps,
                                                                       self.merge_scales))]

    @property
    def valid(self) -> int:
        return self.excluded.count(False)

    def weight(self, index: int, announced) -> float:
        """The weight sender `index` counts with: its announced weight, capped; 0 if excluded."""
        if self.excluded[index] or not isinstance(announced, (int, float)) or not math.isfinite(announced):
            return 0.0
        return max(0.0, min(float(announced), self.weight_caps[index]))


def _lower_median(values: list) -> float:
    """The lower median: with two members, the smaller one (the safer guess of what is normal)."""
    return sorted(values)[(len(values) - 1) // 2] if values else 0.0


class RobustPartReducer(TensorPartReducer):
    """hivemind's reducer with CenteredClip (robust.py) in place of the running weighted mean.

    hivemind reduces a reducer's parts in order (every sender's part k before anyone's part k+1), so
    this holds one part per sender at a time (<= part_size_bytes each, 512 KB), not whole shares:
    group size x 512 KB per round. A merge round's anchor and momentum segments arrive scaled by
    ContributionPolicy.merge_scales (so that a mean yields the merge weights); they are unscaled
    here and aggregated with the merge votes as weights."""

    def setup(self, policy: ContributionPolicy, segments: int = 0, offsets: Optional[list] = None) -> None:
        self.policy, self.segments, self.offsets = policy, segments, offsets or []
        self._aggregating = False  # a part's aggregation runs in the worker thread
        self.inputs: dict[int, tuple] = {}
        # per sender and segment (pseudo-gradient, anchor, momentum): (factor, values, weight) of each part
        self.factors: list[list] = [[[], [], []] for _ in range(self.num_senders)]

    def reset_accumulators(self):
        super().reset_accumulators()
        self.inputs = {}

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        """hivemind's, keeping the part instead of adding it to a running sum."""
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self.inputs[sender_index] = (tensor_part, float(weight))
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await future

    def check_current_part_finished(self):
        """Every sender's part is in: aggregate it in our worker thread (CenteredClip of a part takes tens of
        ms, and at 85M seconds a round, which on the event loop held up the other parts' streams, the other
        members' requests and the DHT); its senders get the average, and the next part opens, when it is done.
        Senders wait for that anyway: each sends its next part after the reply to this one."""
        if self._aggregating or self.current_part_accumulated_from != self.num_current_senders:
            return
        self._aggregating = True
        index, inputs, future = self.current_part_index, self.inputs, self.current_part_future
        work = asyncio.get_event_loop().run_in_executor(_aggregator(), self._aggregate, index, inputs)
        work.add_done_callback(lambda done: self._part_done(future, done))

    def _part_done(self, future: asyncio.Future, done: asyncio.Future) -> None:
        self._aggregating = False
        if self.finished.is_set() or future.done():  # the round ended (finalized, cancelled) meanwhile
            return
        if done.cancelled():  # the aggregation thread stopped (the averager's shutdown)
            future.cancel()
            self.finalize()
            return
        if done.exception() is not None:
            future.set_exception(done.exception())
            self.finalize()
            return
        future.set_result(done.result())
        self.reset_accumulators()

    def _aggregate(self, index: int, inputs: dict) -> torch.Tensor:
        shape = self.part_shapes[index]
        senders = sorted(inputs)
        if not senders:
            return torch.zeros(shape)
        parts = torch.stack([inputs[i][0].reshape(-1).float() for i in senders])
        weights = torch.tensor([inputs[i][1] for i in senders])
        if not self.segments:
            return self._clip(senders, parts, weights, 0).reshape(shape)
        start, n = self.offsets[index], self.segments
        pieces = []
        for segment in range(3):
            lo, hi = max(start, segment * n) - start, min(start + parts.shape[1], (segment + 1) * n) - start
            if lo >= hi:
                continue
            if segment == 0:
                pieces.append(self._clip(senders, parts[:, lo:hi], weights, 0))
                continue
            scales = torch.tensor([self.policy.merge_scales[i] for i in senders])
            votes = torch.tensor([self.policy.merge_votes[i] for i in senders])
            votes = torch.where((scales > 0) & (weights > 0), votes, torch.zeros_like(votes))
            unscaled = parts[:, lo:hi] / torch.where(scales > 0, scales, torch.ones_like(scales))[:, None]
            pieces.append(self._clip(senders, unscaled, votes, segment))
        return torch.cat(pieces).reshape(shape)

    def _clip(self, senders: list, parts: torch.Tensor, weights: torch.Tensor, segment: int) -> torch.Tensor:
        clipped = robust.centered_clip(parts, weights)
        for i, factor, w in zip(senders, clipped.scales, weights.tolist()):
            if w > 0:
                self.factors[i][segment].append((factor, parts.shape[1], w))
        return clipped.average

    def mean_factors(self, segments: tuple = (0,)) -> dict:
        """sender index -> its clip factor averaged over the values it sent, in the segment (of
        `segments`) where it was clipped most (a merge round's anchor alone can be off); only senders
        clipped at all."""
        out = {}
        for i, by_segment in enumerate(self.factors):
            means = [sum(f * n for f, n, _ in parts) / sum(n for _, n, _ in parts)
                     for segment, parts in enumerate(by_segment) if parts and segment in segments]
            if means and min(means) < 1.0 - 1e-6:
                out[i] = min(means)
        return out

    def removed_share(self) -> float:
        """Of the senders' weight on the pseudo-gradient parts we reduced (weight x values), the share
        clipping took: sum w n (1 - f) / sum w n. 0 when nobody was clipped (or under the mean)."""
        total = removed = 0.0
        for by_segment in self.factors:
            for f, n, w in by_segment[0]:
                total += w * n
                removed += w * n * (1.0 - f)
        return removed / total if total > 0 else 0.0


_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def _aggregator() -> concurrent.futures.ThreadPoolExecutor:
    """The averager process's thread for robust aggregation, made on first use (in that process: the
    averager is a child process, and a pool made before it started would not run in it). One thread: a
    part's CenteredClip already runs on torch's intra-op threads, and groups in flight at once are rare."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2pdiloco-aggregate")
        return _pool


def stop_aggregator() -> None:
    """Stop the aggregation thread (the averager's shutdown); a part still in it is dropped with its round."""
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool.shutdown(wait=False, cancel_futures=True)
            _pool = None


class _CountingStub:
    """Wraps a peer stub so the bytes of averaged parts we receive are counted."""

    def __init__(self, stub, runner: "CountingAllReduceRunner"):
        self._stub, self._runner = stub, runner

    async def rpc_aggregate_part(self, inputs):
        stream = await self._stub.rpc_aggregate_part(inputs)
        return self._runner._count(stream, "recv")


class InPlaceParts(TensorPartContainer):
    """hivemind's part container, with each averaged part written into its place in the local
    tensors as it arrives, instead of queued until every earlier part is in: hivemind's reassembly
    keeps a fast reducer's parts (fp32 copies) waiting on a slow one's, ~0.7 GB of an 85M merge round.
    The place is free: a reducer answers part k only after it received our part k (which, sent,
    is serialized; our own reducer has added it to its accumulator), and nothing reads it again.
    Iterating yields each local tensor once all its parts are in place."""

    alpha = 1.0  # deltas (return_deltas) are added with this weight; averages are copied

    def register_failed_reducer(self, peer_index: int):
        """hivemind's, remembering the reducers that failed while the round ran, in order (RoundReport.lost).
        Once the round ended, hivemind cancels every reducer's stream and registers each as failed: those
        are not remembered."""
        failed = self.__dict__.setdefault("failed_reducers", [])
        if not self.finished.is_set() and peer_index not in failed:
            failed.append(peer_index)
        super().register_failed_reducer(peer_index)

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor):
        if self.finished.is_set():  # finalized (the round failed): the places are no longer ours
            return
        if part_index != self._outputs_registered_by_peer[peer_index]:
            raise ValueError(f"Could not register part #{part_index} from peer #{peer_index}, "
                             f"expected part index: {self._outputs_registered_by_peer[peer_index]}")
        place = self._input_parts_by_peer[peer_index][part_index][0]
        if self.return_deltas:
            place.add_(part.reshape(place.shape), alpha=self.alpha)
        else:
            place.copy_(part.reshape(place.shape))
        self._outputs_registered_by_peer[peer_index] += 1
        self._output_part_available[peer_index].set()

    async def iterate_output_tensors(self) -> AsyncIterator[torch.Tensor]:
        assert not self._outputs_consumed, "output tensors are already iterated and no longer available."
        self._outputs_consumed = True
        peer_index = taken = 0  # parts of peer_index's share already accounted to earlier tensors
        for tensor_index, tensor in enumerate(self.local_tensors):
            for _ in range(self.num_parts_by_tensor[tensor_index]):
                while taken >= self.num_parts_by_peer[peer_index]:
                    peer_index, taken = peer_index + 1, 0
                while self._outputs_registered_by_peer[peer_index] <= taken:
                    if self.finished.is_set():
                        raise AllreduceException("All-reduce was terminated during iteration")
                    self._output_part_available[peer_index].clear()
                    await self._output_part_available[peer_index].wait()
                taken += 1
            yield tensor


class CountingAllReduceRunner(AllReduceRunner):
    """hivemind's butterfly all-reduce, counting the bytes of every message it sends and receives,
    and checking every part our reducer accumulates against the group's ContributionPolicy.

    With one of our low-bit codecs (`codec`), a reducer answers every sender with the average
    part itself, encoded once, instead of hivemind's per-sender delta (average - that sender's
    part): a lossy delta would leave each member with a differently rounded average, and the
    anchors of a round's members would drift apart by the codec's error every round. The
    runner's outputs are then averages (`absolute`), not deltas."""

    def __init__(self, *args, policy: Optional[ContributionPolicy] = None,
                 codec: Optional[BlockwiseQuantization] = None, segments: int = 0, alpha: float = 1.0,
                 aggregation: str = "mean", **kwargs):
        self.bytes_sent = self.bytes_recv = 0
        self._serving = 0  # our reducer's result streams to groupmates still open
        self._served = asyncio.Event()
        self._served.set()
        super().__init__(*args, **kwargs)
        # hivemind builds its own container; ours only changes where results go (same fields, no new state)
        self.tensor_part_container.__class__ = InPlaceParts
        self.tensor_part_container.alpha = alpha
        self.codec = codec
        self.absolute = codec is not None
        self._replies: dict[int, asyncio.Future] = {}  # part index -> the encoded average, shared by all senders
        if self.absolute:
            self.tensor_part_container.return_deltas = False
        self.policy = policy
        self.rejected: dict[str, str] = {}
        # a merge round: the vector is 3 segments of `segments` values; each part's flat offset tells
        # which segment(s) it holds, so that each is checked against its own announced norm
        self.segments = segments
        # (values, reducer index) of every part in the buffer's order: hivemind hands out parts in order
        # (peer 0's span first), which is how the members' reducer check (averaging.py) finds each part
        self._layout = [(len(part), reducer) for reducer, parts in
                        enumerate(self.tensor_part_container._input_parts_by_peer) for part, _ in parts]
        self._part_offsets: list[int] = []
        if segments:
            me = self.ordered_peer_ids.index(self.peer_id)
            lengths = [[len(part) for part, _ in parts] for parts in self.tensor_part_container._input_parts_by_peer]
            offset = sum(sum(lens) for lens in lengths[:me])
            for length in lengths[me]:
                self._part_offsets.append(offset)
                offset += length
        self.robust = aggregation == "centered_clip" and policy is not None
        if self.robust:  # same fields, parts kept instead of summed (set up before any part arrives)
            self.tensor_part_reducer.__class__ = RobustPartReducer
            self.tensor_part_reducer.setup(policy, segments, self._part_offsets)
        self._lie = -float(TEST_ATTACK.removeprefix("lie:")) if TEST_ATTACK.startswith("lie:") else None
        if policy is not None:
            for index, note in policy.notes.items():
                self.rejected[str(self.sender_peer_ids[index])] = note
            self._accumulate = self.tensor_part_reducer.accumulate_part
            self.tensor_part_reducer.accumulate_part = self._checked_accumulate

    async def _checked_accumulate(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                                  weight: float = 1.0):
        policy = self.policy
        expected = self.tensor_part_reducer.part_shapes[part_index]
        problem = None
        if tensor_part.shape != expected or not tensor_part.dtype.is_floating_point:
            problem = f"part of shape {tuple(tensor_part.shape)} {tensor_part.dtype}, expected {tuple(expected)}"
        elif not torch.isfinite(tensor_part).all():
            problem = "non-finite values"
        elif policy.excluded[sender_index]:
            problem = policy.notes.get(sender_index, "excluded")
        elif self.segments:
            problem = self._segment_problem(sender_index, part_index, tensor_part)
        elif float(tensor_part.float().norm()) > policy.norm_caps[sender_index]:
            problem = "part larger than its announced norm"
        if problem is not None:
            self.rejected.setdefault(str(self.sender_peer_ids[sender_index]), problem)
            return await self._accumulate(sender_index, part_index, torch.zeros(expected), weight=0.0)
        # the weight it announced when the group formed (capped), whatever its stream claims
        averaged = await self._accumulate(sender_index, part_index, tensor_part, weight=policy.weights[sender_index])
        return averaged * self._lie if self._lie is not None else averaged

    def finalize(self, *, cancel: bool = False, exception: Optional[BaseException] = None):
        """hivemind's; a round cancelled (its allreduce_timeout, a member gone) stored the CancelledError
        as the exception of a future nobody reads, which asyncio printed with a traceback when the future
        was collected: it is a cancellation."""
        if isinstance(exception, asyncio.CancelledError):
            cancel, exception = True, None
        super().finalize(cancel=cancel, exception=exception)

    def _segment_problem(self, sender_index: int, part_index: int, tensor_part: torch.Tensor) -> Optional[str]:
        start, n = self._part_offsets[part_index], self.segments
        flat = tensor_part.reshape(-1).float()
        for segment, (name, cap) in enumerate(zip(("pseudo-gradient", "anchor", "momentum"),
                                                  self.policy.segment_caps[sender_index])):
            lo, hi = max(start, segment * n), min(start + flat.numel(), (segment + 1) * n)
            if lo < hi and float(flat[lo - start:hi - start].norm()) > cap:
                return f"{name} part larger than its announced norm"
        return None

    # --- low-bit codecs: absolute replies, encoded once per part -------------------------------

    def _encoded_average(self, part_index: int, averaged: torch.Tensor) -> asyncio.Future:
        reply = self._replies.get(part_index)
        if reply is None:
            reply = asyncio.get_event_loop().run_in_executor(None, self.codec.compress, averaged)
            self._replies[part_index] = reply
        return reply

    def _decode_part(self, sender_index: int, part_index: int, message) -> torch.Tensor:
        """A sender's part; one that does not decode becomes NaN, which the policy check rejects."""
        expected = self.tensor_part_reducer.part_shapes[part_index]
        try:
            return self.codec.extract(message).reshape(expected)
        except (ValueError, RuntimeError) as e:
            self.rejected.setdefault(str(self.sender_peer_ids[sender_index]), f"undecodable part: {e}")
            return torch.full(expected, math.nan)

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        if not self.absolute:
            async for msg in super()._accumulate_parts_streaming(stream, sender_index):
                yield msg
            return
        part_index = 0
        loop = asyncio.get_event_loop()
        try:
            async for msg in stream:
                part = await loop.run_in_executor(None, self._decode_part, sender_index, part_index, msg.tensor_part)
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part,
                                                                              weight=msg.weight)
                except BannedException:
                    break
                reply = await self._encoded_average(part_index, averaged)
                part_index += 1
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=reply)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    async def _communicate_with_peer(self, peer_id):
        if not self.absolute:
            return await super()._communicate_with_peer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        container = self.tensor_part_container
        if peer_id == self.peer_id:  # our own reducer: keep the same rounded average the others get
            sender_index = self.sender_peer_ids.index(peer_id)
            for part_index, part in enumerate(self.parts_for_local_averaging):
                averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part,
                                                                          weight=self.weight)
                reply = await self._encoded_average(part_index, averaged)
                container.register_processed_part(peer_index, part_index, self.codec.extract(reply))
            return
        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            part_index = 0
            loop = asyncio.get_event_loop()
            async for msg in aiter_with_timeout(stream, self.reducer_timeout):
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                averaged = await loop.run_in_executor(None, self.codec.extract, msg.tensor_part)
                container.register_processed_part(peer_index, part_index, averaged)
                part_index += 1
            if part_index != container.num_parts_by_peer[peer_index]:
                raise AllreduceException(f"{peer_id} sent {part_index} parts, expected "
                                         f"{container.num_parts_by_peer[peer_index]}")
        except BaseException:
            container.register_failed_reducer(peer_index)  # counted in failed_size: the round is discarded
            raise

    async def _count(self, stream, direction: str):
        async for msg in stream:
            if direction == "sent":
                self.bytes_sent += msg.ByteSize()
            else:
                self.bytes_recv += msg.ByteSize()
            yield msg

    def _get_peer_stub(self, peer):
        return _CountingStub(super()._get_peer_stub(peer), self)

    def _generate_input_for_peer(self, peer_index: int):
        return self._count(self._parts_then_hold(peer_index), "sent")

    async def _parts_then_hold(self, peer_index: int):
        """Our parts for one reducer, then the end of the stream only once its replies are all in. The
        reducer ends its side on our end-of-stream, which used to be queued before its last reply was
        even computed: it closed the stream right after sending that reply, and in ~0.5% of streams
        the reply was lost between the two p2pd daemons. Our round then lacked a part and the whole
        group discarded the round (docs/scale.md, "8 peers, paced"). A client-mode sender gets its
        replies only after its stream ends: it does not hold."""
        async for message in super()._generate_input_for_peer(peer_index):
            yield message
        if self.should_delay_results(self.peer_id):
            return
        container, loop = self.tensor_part_container, asyncio.get_event_loop()
        deadline = loop.time() + (self.reducer_timeout or 10.0)
        while (container._outputs_registered_by_peer[peer_index] < container.num_parts_by_peer[peer_index]
               and not container.finished.is_set() and loop.time() < deadline):
            await asyncio.sleep(0.005)

    async def rpc_aggregate_part(self, stream, context):
        self._serving += 1
        self._served.clear()
        try:
            async for msg in self._count(super().rpc_aggregate_part(self._count(stream, "recv"), context), "sent"):
                yield msg
        finally:
            self._serving -= 1
            if self._serving == 0:
                self._served.set()

    async def wait_served(self, timeout: float) -> None:
        """Our own average can be complete while our reducer still streams results to others."""
        try:
            await asyncio.wait_for(self._served.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def report(self) -> RoundReport:
        problems = []
        failed = self.tensor_part_container.failed_size
        if failed:
            problems.append(f"{failed} of {self.tensor_part_container.total_size} values never came back")
        if self.banned_senders:
            problems.append(f"reducer dropped {len(self.banned_senders)} sender(s)")
        clipped, merge_clipped, removed = {}, {}, 0.0
        if self.robust:
            reducer = self.tensor_part_reducer
            clipped = {str(self.sender_peer_ids[i]): f for i, f in reducer.mean_factors((0,)).items()}
            merge_clipped = {str(self.sender_peer_ids[i]): f for i, f in reducer.mean_factors((1, 2)).items()}
            removed = reducer.removed_share()
        # who vanished: a sender that did not hand our reducer all its parts, and the first reducer that failed
        # us. Not every sender hivemind banned (once our reducer is finalized it bans each whose stream is still
        # open) nor every reducer whose stream broke (the members whose round failed first close theirs): counted,
        # all 7 groupmates of a paced 8 were taken for gone after one member's loss (docs/scale.md)
        reducer = self.tensor_part_reducer
        lost = {str(p) for i, p in enumerate(self.sender_peer_ids)
                if reducer.num_parts and reducer.num_parts_received[i] < reducer.num_parts}
        failed = self.tensor_part_container.__dict__.get("failed_reducers", [])
        lost |= {str(self.ordered_peer_ids[i]) for i in failed[:1]}
        lost.discard(str(self.peer_id))
        return RoundReport(group_id=self.group_id.hex(), complete=not problems, reason="; ".join(problems),
                           bytes_sent=self.bytes_sent, bytes_recv=self.bytes_recv, rejected=dict(self.rejected),
                           merged=bool(self.segments), clipped=clipped, merge_clipped=merge_clipped,
                           removed=removed, layout=self._layout, lost=sorted(lost))


