"""Background averaging rounds of pseudo-gradients, and the checks that make a round all-or-nothing.

hivemind 1.1.12 reports success for rounds that were only partly averaged (a groupmate died or a
part timed out): some members then hold a mix of 4-way means, 3-way means and their own values.
Only the member that lost a part knows. So each member:

1. runs the all-reduce on a fresh copy of its pseudo-gradient (no retries on half-updated buffers);
2. inspects its own runner inside the averager process (`RoundReport`): parts it never got back
   (`failed_size`), senders its reducer had to drop, bytes it sent and received;
3. publishes a verdict for this group in the DHT and waits for every member's verdict;
4. with `check_reducers`, checks with the others that every reducer returned the aggregate of what
   it was sent (robust.py: each member's projected term of the fixed-point condition, published
   in a second DHT record; the terms of a part must sum to about zero);
5. applies the average only if every member of the group said "complete", no reducer failed the
   check and the result is finite.

A member that died never publishes its verdict, so everyone discards the round.

    >>> averager = DilocoAverager(buffer, dht, cfg=cfg, shared=peer.shared)
    >>> rounds = RoundRunner(averager, dht, cfg)
    >>> future = rounds.start(pseudo_grad, weight=tokens, gather={"outer_step": 3})
    >>> outcome = future.result()      # RoundOutcome: .ok, .average, .members, .reason

Tuning: `matchmaking_time` is the window in which ready peers gather; `allreduce_timeout` bounds a
round once the group is formed (a frozen peer would otherwise hang it for minutes); keep
`request_timeout` below `matchmaking_time`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import hmac
import logging
import math
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

import hivemind
import torch
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.group_info import GroupInfo
from hivemind.compression import NoCompression
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco import diloco, robust
from p2pdiloco.allreduce import ContributionPolicy, CountingAllReduceRunner, RoundReport, stop_aggregator
from p2pdiloco.check import RoundCheck
from p2pdiloco.compression import BlockwiseQuantization, bytes_per_value, make_codec
from p2pdiloco.data.fetch import ShardCache, ShardSharing
from p2pdiloco.pipes import guard_pipes
from p2pdiloco.secret import peer_token
from p2pdiloco.state import SharedState, StateSharing, all_finite, release_pages

logger = logging.getLogger(__name__)


ALLREDUCE_PIECE = 2**22  # values per tensor handed to hivemind's all-reduce (16 MB in fp32)
ALLREDUCE_FAILED = "Unable to run All-Reduce"  # hivemind's message for a round that failed once formed
JOIN_LINGER_S = 5.0  # the longest a leader keeps a join stream open after its last answer (rpc_join_group)
ABSTAIN = "abstain"  # verdict of a member whose own contribution was excluded: it does not apply, others may


def _lonely_round(record: logging.LogRecord) -> bool:
    return "could not find a group" not in record.getMessage()


def _one_line(record: logging.LogRecord, message: str) -> None:
    record.msg, record.args = " ".join(message.split()), ()
    record.exc_info = record.exc_text = None
    record.levelno, record.levelname = logging.WARNING, "WARNING"


def _one_line_download_failure(record: logging.LogRecord) -> bool:
    """A state source that cannot be dialed or leaves mid-download is expected (the joiner tries the
    next one): one warning line instead of hivemind's ERROR with a traceback."""
    message = record.getMessage()
    if message.startswith("Failed to download state from"):
        _one_line(record, message)
    return True


def _one_line_failed_round(record: logging.LogRecord) -> bool:
    """A groupmate that leaves, stalls (a laptop that sleeps, SIGSTOP) or is too slow ends a round with
    hivemind's "Unable to run All-Reduce" ERROR and two chained tracebacks: expected, and reported as a
    round_failed event; one warning line (with why, when hivemind's message is empty: a timeout)."""
    if record.funcName == "_aggregate_with_group" and record.exc_info:  # the same error, logged first with
        return False  # its traceback, then raised again as "Unable to run All-Reduce: <it>" (the line below)
    message = record.getMessage()
    if message.startswith(ALLREDUCE_FAILED):
        _one_line(record, failed_round_reason(message, timeout=None))
    return True


def _one_line_asyncio_report(record: logging.LogRecord) -> bool:
    """asyncio's "unhandled" reports of three expected events, each one warning line: hivemind's p2pd
    bindings leave a stream that a peer closed (or that outlived a SIGSTOP) to asyncio, and an answer
    they were still writing to a peer that gave up on the round (8 paced peers printed 9 tracebacks
    when one member left a formed group); hivemind's averager announces itself every 10 s in a task
    nobody awaits, whose store times out when the DHT is slow (after a SIGSTOP, on a loaded machine)."""
    message = record.getMessage()
    error = record.exc_info[1] if record.exc_info else None
    if message.startswith("Unhandled exception in client_connected_cb") and error is not None:
        _one_line(record, f"p2p: a stream from a peer ended early ({type(error).__name__}: {error})")
    elif message.startswith("Task exception was never retrieved") and isinstance(error, ConnectionResetError):
        _one_line(record, f"p2p: a peer closed a stream before our answer was written ({error})")
    elif message.startswith("Task exception was never retrieved") and isinstance(
            error, (TimeoutError, asyncio.TimeoutError)):
        _one_line(record, "DHT: a background store (hivemind's averager announcement) timed out")
    return True


def _one_line_stream_reset(record: logging.LogRecord) -> bool:
    """A peer killed while it streamed requests to one of our handlers resets the connection: hivemind's p2p
    layer takes a closed stream for the end of the requests (asyncio.IncompleteReadError) but logs a reset
    with its traceback (a survivor of a SIGKILL mid-round, in the suite). One warning line."""
    error = record.exc_info[1] if record.exc_info else None
    if record.getMessage().startswith("Exception while receiving requests") and isinstance(error, ConnectionError):
        _one_line(record, f"p2p: a peer's stream was cut while we read its requests, it left ({error})")
    return True


def _request_of_an_exited_process(record: logging.LogRecord) -> bool:
    """A DHT request, or a future's update, that carries a pipe end (hivemind's futures) and is read
    after its sender exited (at the end of a run): its pipe cannot be rebuilt. Nothing waits for the
    answer: dropped, instead of hivemind's ERROR with a traceback. Other failed reads become one
    warning line."""
    if record.funcName not in ("_run", "_process_updates_in_background") or not record.exc_info:
        return True
    error = record.exc_info[1]
    if isinstance(error, (FileNotFoundError, ConnectionRefusedError)):
        return False
    _one_line(record, f"hivemind: a message between this peer's processes could not be read "
                      f"({type(error).__name__}: {error})")
    return True


def failed_round_reason(message: str, timeout: Optional[float]) -> str:
    """hivemind's "Unable to run All-Reduce: <why>"; <why> is empty when the round was cancelled by
    its allreduce_timeout (hivemind wraps the CancelledError)."""
    why = message[len(ALLREDUCE_FAILED):].strip(" :")
    if why:
        return f"all-reduce failed: {why}"
    limit = f" within allreduce_timeout={timeout:g}s" if timeout is not None else " within allreduce_timeout"
    return f"all-reduce did not finish{limit} (a groupmate left, stalled or was too slow)"


def quiet_expected_events() -> None:
    """Expected events that hivemind logs as errors with tracebacks (each rule above says which):
    dropped, or one warning line; a round that failed is reported as a round_failed event anyway.
    Installed before the averager and DHT processes fork."""
    rules = {
        "hivemind.averaging.averager": (_lonely_round, _one_line_download_failure, _one_line_failed_round,
                                        _request_of_an_exited_process),
        "hivemind.dht.dht": (_request_of_an_exited_process,),
        "hivemind.utils.mpfuture": (_request_of_an_exited_process,),
        "asyncio": (_one_line_asyncio_report,),
        "hivemind.p2p.p2p_daemon": (_one_line_stream_reset,),
    }
    for name, filters in rules.items():
        log = logging.getLogger(name)
        for rule in filters:
            if rule not in log.filters:
                log.addFilter(rule)


@dataclass
class RoundOutcome:
    ok: bool
    reason: str = ""
    average: Optional[torch.Tensor] = None
    members: dict = field(default_factory=dict)  # peer id (str) -> gathered metadata
    report: Optional[RoundReport] = None
    round_s: float = 0.0
    anchor: Optional[torch.Tensor] = None    # a merge round: the members' merged anchor ...
    momentum: Optional[torch.Tensor] = None  # ... and outer momentum, before this round's outer step
    check: Optional[dict] = None             # the reducer check: ok, bad (reducer peer ids), members, stat, check_s
    lost: list = field(default_factory=list)  # members that vanished mid-round (RoundReport.lost, or no record came)


class Missing(str):
    """Why a gather of the members' records failed, and whose records never came (`peers`)."""

    peers: tuple = ()


async def _keep_key(group_info) -> None:
    """In place of hivemind's re-keying after a group assembled: the key stays where the grid set it."""


class DilocoAverager(StateSharing, ShardSharing, hivemind.DecentralizedAverager):
    """A DecentralizedAverager whose step() also returns a RoundReport, and that serves chunks of
    `shared` (the trainer's SharedState) to joiners and fetches the swarm's state into `staging`
    (state.StateSharing). hivemind's own one-source download (rpc_download_state) serves nothing.
    With `shards` (name -> (path, size) of the whole token shards we hold) and `shard_cache`, it
    serves those shards and fetches others into the cache (data/fetch.py's ShardSharing).

    merge_size = N (> 0): the one averaged buffer holds [pseudo-gradient | anchor | momentum], N
    values each. A round averages the first segment only, unless the members' announced anchor
    digests differ: then it is a merge round that averages all three in fp32 (see
    ContributionPolicy and diloco.merge_weights), and nobody needs to download a state."""

    def __init__(self, averaged_tensors, dht, *, cfg, shared: Optional[SharedState] = None, slots: int = 1,
                 merge_size: int = 0, client_mode: Optional[bool] = None, shards: Optional[dict] = None,
                 shard_cache: Optional[ShardCache] = None, **kwargs):
        self._shared, self._cfg = shared, cfg
        self._shard_files, self._shard_cache, self._shard_banned = dict(shards or {}), shard_cache, set()
        # downloads land in the round buffer when it holds 2N values (idle between rounds), else in their own
        numel = shared.numel if shared is not None else 0
        size = sum(t.numel() for t in averaged_tensors)
        self._staging_buf = torch.empty(2 * numel).share_memory_() if numel and size < 2 * numel else None
        # a merge round's anchor and momentum segments: filled by the averager process from `shared` when
        # the group decides to merge (unless the trainer already put its own values there: tests)
        self._merge_filled = mp.Value(ctypes.c_bool, False)
        self._slots = slots  # > 1: each member's pseudo-gradient keeps its own slot (outer_apply = per_contribution)
        self.merge_size = merge_size
        assert not merge_size or sum(t.numel() for t in averaged_tensors) == 3 * merge_size
        self._anchor_tolerance = cfg.anchor_tolerance
        self._reports: dict[bytes, RoundReport] = {}
        self._max_norm_ratio = cfg.max_norm_ratio
        self._aggregation = aggregation_of(cfg)
        self._banned: set[str] = set()  # peer ids kept out of our groups (suspects.py), set by the trainer
        # the same, on the trainer's side of the process boundary: a round whose group holds one of them (a third
        # peer led it) is not applied by us, and our False verdict keeps the other members from applying it
        self.banned_here: frozenset = frozenset()
        self._secret = cfg.run_secret
        compression = make_codec(cfg.compression)
        self._codec = compression if isinstance(compression, BlockwiseQuantization) else None
        # hivemind hands whole parts to reducers: small parts spread a small model over the group
        values = merge_size or sum(t.numel() for t in averaged_tensors)
        vector_bytes = int(values * bytes_per_value(cfg.compression))
        part_size_bytes = min(2**19, max(2**14, vector_bytes // 32))
        super().__init__(
            averaged_tensors, dht, prefix=cfg.dht_prefix, start=False,
            target_group_size=cfg.target_group_size, min_group_size=cfg.min_group_size,
            min_matchmaking_time=cfg.matchmaking_time, request_timeout=cfg.request_timeout,
            allreduce_timeout=cfg.allreduce_timeout, next_chunk_timeout=cfg.next_chunk_timeout,
            compression=compression, state_compression=NoCompression(),
            allow_state_sharing=False, declare_state_period=10.0,
            client_mode=cfg.client_mode if client_mode is None else client_mode,
            part_size_bytes=part_size_bytes, shutdown_timeout=3, **kwargs,
        )
        guard_pipes(self)  # several threads send; the process reads with uvloop (pipes.py)
        self.run_in_background(await_ready=True)

    def set_target_group_size(self, size: int) -> None:
        """From the next matchmaking on, a group forms as soon as it has `size` members (else when
        the matchmaking window ends, with whoever came)."""
        self._outer_pipe.send(("_set_target_group_size", [int(size)], {}))

    async def _set_target_group_size(self, size: int) -> None:
        self._matchmaking.target_group_size = size
        self._matchmaking.potential_leaders.target_group_size = size

    async def _set_group_bits(self, group_bits: str, future) -> None:
        # hivemind moves the key itself after every assembled group (GroupKeyManager.update_key_on_group_assembled
        # shifts the bits by log2(target_group_size) random ones): the grid's key (grid.key_bits) then lasted only
        # until our first group, and a peer whose next round had the same bits searched under the shifted key
        # alone (8 peers on lines of 3: 0.54-0.86 of entries met nobody). The key is the grid's alone
        self._matchmaking.group_key_manager.update_key_on_group_assembled = _keep_key
        await super()._set_group_bits(group_bits, future)

    def set_banned(self, peers: list) -> None:
        """From now on, refuse these peers' join requests, do not ask to join their groups, and veto a round
        whose group holds one of them."""
        self.banned_here = frozenset(peers)
        self._outer_pipe.send(("_set_banned", [list(peers)], {}))

    async def _set_banned(self, peers: list) -> None:
        self._banned = set(peers)
        matchmaking = self._matchmaking
        if getattr(matchmaking, "_skips_banned", False):
            return
        request = matchmaking._request_join_group

        async def request_unless_banned(leader):  # hivemind asks the next potential leader on None
            return None if str(leader) in self._banned else await request(leader)

        matchmaking._request_join_group, matchmaking._skips_banned = request_unless_banned, True

    async def _shutdown(self, timeout: Optional[float]) -> None:
        """hivemind's, mended: it called finalize() on the futures of its running groups (and
        gathered finalize's None), so a peer stopped mid-round printed an AttributeError traceback."""
        if not self.client_mode:
            await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        for group in self._running_groups.values():
            if group.done() and not group.cancelled() and group.exception() is None:
                group.result().finalize(cancel=True)
            else:
                group.cancel()
        stop_aggregator()

    @property
    def staging(self) -> torch.Tensor:
        """2N values that a state download writes into: the tail of the round buffer, or our own."""
        if self._staging_buf is not None:
            return self._staging_buf
        return self._averaged_tensors[0][-2 * self._shared.numel:]

    def release_staging(self) -> None:
        """Give the memory of the staging area (a merge round's segments) back to the system until the
        next download or merge round: most rounds never touch it (state.release_pages)."""
        if self._shared is not None:
            release_pages(self.staging)

    # --- with a run secret: only peers that know it may join our groups or download our state ---

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self._secret and not self._knows_secret(request.gather, str(context.remote_id)):
            logger.warning(f"refused a join request from {context.remote_id}: no valid run-secret token")
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        elif str(context.remote_id) in self._banned:  # banned by this peer (suspects.py): no log line per request
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        else:
            async for response in super().rpc_join_group(request, context):
                yield response
        # Our answers are all sent; the follower, not us, closes the stream. When we closed it first, a
        # BEGIN_ALLREDUCE now and then never reached its follower (3 rounds of about 215 of 8 paced peers,
        # docs/scale.md): the follower read the end of the stream instead, waited out its deadline ("no
        # group") outside a group whose 7 others waited for its parts ("incomplete round"), and the round was
        # lost for all. The last message is dropped between the two p2pd daemons, as an all-reduce reply was
        # (allreduce.py, _parts_then_hold). hivemind's p2p layer cancels this handler once the follower closes.
        await asyncio.sleep(JOIN_LINGER_S)

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's one-source download, which cloned the whole state per request: replaced by
        rpc_state_chunk (state.StateSharing). Serves nothing."""
        return
        yield

    async def _is_run_member(self, context: P2PContext, what: str) -> bool:
        """With a run secret: only peers in the run's (MACed) member record may download our state."""
        if not self._secret:
            return True
        try:  # bounded: hivemind's DHT.get never returns on a record it cannot decode
            found = await asyncio.wait_for(
                self.dht.get(f"{self.prefix}_members", latest=True, return_future=True), timeout=10)
        except asyncio.TimeoutError:
            found = None
        members = found.value if found is not None and isinstance(found.value, dict) else {}
        if str(context.remote_id) not in {str(k) for k in members}:
            logger.warning(f"refused a {what} by {context.remote_id}: not a member of this run")
            return False
        return True

    def _knows_secret(self, gather_bytes: bytes, peer_id: str) -> bool:
        try:
            user_data = self.serializer.loads(self.serializer.loads(gather_bytes)[2])
            token = user_data.get("token", "")
        except Exception:  # malformed gather from a stranger: refuse
            return False
        return isinstance(token, str) and hmac.compare_digest(token, peer_token(self._secret, peer_id))

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        try:
            gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        finally:  # a failed round's report too (hivemind raises, or allreduce_timeout cancels us): nothing reads it
            report = self._reports.pop(group_info.group_id, None)
        if report is None:
            report = RoundReport(group_id=group_info.group_id.hex(), complete=False, reason="no report")
        return {"gathered": {str(k): v for k, v in gathered.items()}, "report": report}

    async def _run_allreduce_inplace_(self, tensors, group_info: GroupInfo, group_id=None, **kwargs):
        # same as hivemind's, with our counting runner and a report kept for _aggregate_with_group
        group_id = group_info.group_id if group_id is None else group_id
        if self._slots > 1:  # move our pseudo-gradient from slot 0 to our place in the group
            (buffer,) = tensors
            slot, n = group_info.peer_ids.index(self.peer_id), buffer.numel() // self._slots
            if slot:
                buffer[slot * n:(slot + 1) * n].copy_(buffer[:n])
                buffer[:n].zero_()
        gathered = [self.serializer.loads(self.serializer.loads(raw)[2]) for raw in group_info.gathered]
        modes = kwargs.get("modes") or [AveragingMode.NODE] * len(gathered)
        senders = [g for g, mode in zip(gathered, modes) if mode != AveragingMode.AUX]
        sender_ids = [p for p, mode in zip(group_info.peer_ids, modes) if mode != AveragingMode.AUX]
        merge = diloco.merge_weights(senders, self._anchor_tolerance) if self.merge_size else None
        codec, segments = self._codec, 0
        slack = codec.norm_slack if codec is not None else 1.01
        policy = ContributionPolicy.from_gathered(senders, max_norm_ratio=self._max_norm_ratio, norm_slack=slack,
                                                  merge=merge, weight_ratio=weight_ratio(self._aggregation))
        if self.merge_size:
            (buffer,) = tensors
            n = self.merge_size
            if merge is None:
                tensors = [buffer[:n]]
            elif policy.merge_problem:
                self._reports[group_id] = RoundReport(group_id=group_id.hex(), complete=False,
                                                      reason=policy.merge_problem, merged=True)
                raise AllreduceException(policy.merge_problem)
            else:  # a merge round: all three segments, in fp32, anchor and momentum scaled (ContributionPolicy)
                scale = policy.merge_scales[sender_ids.index(self.peer_id)] if self.peer_id in sender_ids else 0.0
                if scale and not self._merge_filled.value:  # the trainer does not write them while we run
                    buffer[n:2 * n].copy_(self._shared.anchor)
                    buffer[2 * n:].copy_(self._shared.momentum)
                if scale:
                    buffer[n:].mul_(scale)
                else:  # a member behind (or excluded) sends zeros, whatever its own values are, and adopts the average
                    buffer[n:].zero_()
                kwargs["compression"] = NoCompression()
                codec, segments = None, n
        # in pieces: hivemind assembles each averaged tensor whole before handing it back, so one
        # 85M-value tensor held its received parts and their concatenation at once (GBs at the peak)
        tensors = [piece for tensor in tensors for piece in tensor.split(ALLREDUCE_PIECE)]
        runner = CountingAllReduceRunner(
            p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors, group_id=group_id,
            ordered_peer_ids=group_info.peer_ids, policy=policy, codec=codec, segments=segments,
            alpha=self._averaging_alpha, aggregation=self._aggregation, **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        try:
            if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
                async for _ in runner:  # InPlaceParts: each tensor is averaged in place when it is yielded
                    pass
            else:
                async for _ in runner:
                    raise ValueError("aux peers should not receive averaged tensors")
            await runner.wait_served(timeout=self.next_chunk_timeout or 5.0)
        finally:
            self._reports[group_id] = runner.report()


class RoundRunner:
    """Runs one averaging round at a time in a background thread; the trainer polls the future."""

    def __init__(self, averager: DilocoAverager, dht: hivemind.DHT, cfg):
        self.averager, self.dht, self.cfg = averager, dht, cfg
        self.peer_id = str(dht.peer_id)

    def start(self, pseudo_grad: torch.Tensor | Callable[[], tuple], *, weight: float, gather: dict,
              anchor: Optional[torch.Tensor] = None, momentum: Optional[torch.Tensor] = None,
              on_allreduce: Optional[Callable[[], None]] = None,
              settle: Optional[Callable[[RoundOutcome], Any]] = None) -> concurrent.futures.Future:
        """Run one round in a daemon thread (a round stuck in hivemind must not block the exit).
        anchor and momentum: with a merge-capable averager, what a merge round would average (the
        gather must then carry this member's anchor `digest` and `outer_step`). pseudo_grad may be a
        function, called first in that thread, that returns (pseudo-gradient, anchor, momentum, more
        gather fields): the trainer's arithmetic then runs there, not in the caller's thread.
        on_allreduce is called (from that thread) once the group is formed and the all-reduce begins;
        settle(outcome), in that thread after the round, gives the future's result (else the outcome)."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        if not callable(pseudo_grad):
            given = (pseudo_grad, anchor, momentum, {})

            def pseudo_grad() -> tuple:
                return given
        del anchor, momentum

        def target() -> None:
            try:
                delta, anchor, momentum, fields = pseudo_grad()
                # _run drops these once they are in the averager's buffer: it keeps no tensor of the
                # model's size alive for the whole round (the caller decides what it keeps)
                payload = [delta, (anchor, momentum) if self.averager.merge_size else None]
                del delta, anchor, momentum
                outcome = self._run(payload, weight, {**gather, **fields}, on_allreduce)
                future.set_result(settle(outcome) if settle is not None else outcome)
            except BaseException as e:
                future.set_exception(e)

        threading.Thread(target=target, name="averaging-round", daemon=True).start()
        return future

    def _run(self, payload: list, weight: float, gather: dict, on_allreduce) -> RoundOutcome:
        """The round. The outcome's average (and a merge round's anchor and momentum) are views of
        the averager's buffer, not copies: valid until the next round starts."""
        t0 = time.monotonic()
        pseudo_grad, merging = payload
        n = pseudo_grad.numel()
        gather = {**gather, "norm": float(pseudo_grad.norm()), "weight": weight}
        with self.averager.get_tensors() as (buffer,):
            if merging is not None:
                shared = self.averager._shared
                # the live state is copied into the merge segments only if the group merges (averager
                # process); anything else (a test's corrupted anchor) is copied here
                own = shared is None or merging[0].data_ptr() != shared.anchor.data_ptr()
                self.averager._merge_filled.value = own
                for segment, (key, tensor) in enumerate(zip(("anchor_norm", "momentum_norm"), merging), start=1):
                    if own:
                        buffer[segment * n:(segment + 1) * n].copy_(tensor)
                    gather[key] = float(tensor.norm())
            elif buffer.numel() != n:  # per_contribution: slot 0, the averager moves it
                buffer.zero_()
            buffer[:n].copy_(pseudo_grad)
        payload.clear()
        # what we sent, for the reducer check (the caller keeps the pseudo-gradient for the eager
        # correction anyway; the anchor and momentum are the live state, unchanged while a round runs)
        sent = [pseudo_grad, *(merging or ())] if checks_reducers(self.cfg) else None
        del pseudo_grad
        if self.cfg.run_secret:
            gather["token"] = peer_token(self.cfg.run_secret, self.peer_id)
        try:
            control = self.averager.step(
                gather=gather, weight=weight, allow_retries=False, wait=False,
                timeout=self.cfg.matchmaking_time * 2 + self.cfg.request_timeout,
            )
            while not control.done():
                if control.stage == AveragingStage.RUNNING_ALLREDUCE and on_allreduce is not None:
                    on_allreduce()
                    on_allreduce = None
                time.sleep(0.02)
            result = control.result()
        except BaseException as e:  # hivemind raises many types here, all meaning "no usable round"
            # the step control keeps e, e's traceback keeps this frame and the frame `sent`: a cycle that
            # only the garbage collector breaks, maybe minutes later (0.35 GB per failed round at 85M; docs/scale.md)
            e.__traceback__ = None
            reason = str(e) or type(e).__name__
            if "could not find a group" in reason:
                reason = "no group: nobody else was ready in the matchmaking window"
            elif reason.startswith(ALLREDUCE_FAILED) or isinstance(e, (TimeoutError, asyncio.TimeoutError)):
                reason = failed_round_reason(reason if reason.startswith(ALLREDUCE_FAILED) else ALLREDUCE_FAILED,
                                             self.cfg.allreduce_timeout)
            return RoundOutcome(ok=False, reason=reason[:300], round_s=time.monotonic() - t0)
        if result is None:
            return RoundOutcome(ok=False, reason="no group", round_s=time.monotonic() - t0)
        members, report = result["gathered"], result["report"]
        outcome = RoundOutcome(ok=False, members=members, report=report)
        # every member derives the same policy from the same announcements
        merge = diloco.merge_weights(list(members.values()), self.cfg.anchor_tolerance) if report.merged else None
        aggregation = aggregation_of(self.cfg)
        policy = ContributionPolicy.from_gathered(list(members.values()), max_norm_ratio=self.cfg.max_norm_ratio,
                                                  merge=merge, weight_ratio=weight_ratio(aggregation))
        mine = list(members).index(self.peer_id) if self.peer_id in members else -1
        if policy.valid < self.cfg.min_group_size:
            outcome.reason = f"only {policy.valid} usable contribution(s) in a group of {len(members)}"
        else:
            with self.averager.get_tensors() as (buffer,):
                average = buffer[:n] if merging is not None else buffer
                if report.merged:
                    outcome.anchor, outcome.momentum = buffer[n:2 * n], buffer[2 * n:]
            finite = all(all_finite(t) for t in (average, outcome.anchor, outcome.momentum)
                         if t is not None)
            # hivemind adds the group's delta to our own values: if the reducers excluded ours, our
            # copy of the average is off, but the round is fine for the others
            own_bad = mine < 0 or policy.excluded[mine] or self.peer_id in report.rejected
            # a peer we banned got into the group through a third member that leads it: its part counted like
            # any other (docs/security.md, "Two colluders of seven"); nobody applies this round
            banned = sorted(set(members) & self.averager.banned_here)
            verdict = ABSTAIN if (report.complete and own_bad) else (report.complete and finite and not banned)
            check = None
            if sent is not None and verdict is not False and (not report.merged or len(sent) == 3):
                with self.averager.get_tensors() as (buffer,):
                    check = RoundCheck(report, policy, aggregation, sent=sent, buffer=buffer,
                                       merge_size=n if merging is not None else 0, me=self.peer_id,
                                       members=list(members))
            evidence = check.evidence(verdict is True) if check is not None else {}
            all_ok, why, records = self._agree(report.group_id, list(members), verdict, evidence, check is not None,
                                               lost=report.lost if not report.complete else ())
            outcome.lost = list(getattr(why, "peers", ()))
            if all_ok and check is not None:
                outcome.check = self._check(check, records)
                outcome.lost = list(outcome.check.get("missing_peers", ()))
                if not outcome.check["ok"]:
                    why = outcome.check.get("missing") or (
                        f"reducer(s) {', '.join(p[-6:] for p in outcome.check['bad'])} failed the check "
                        f"(statistic {outcome.check['stat']:.3g})")
                    all_ok = False
            if not report.complete:
                outcome.reason = f"incomplete round: {report.reason}"
                outcome.lost = sorted(set(outcome.lost) | set(report.lost))
            elif own_bad:
                note = policy.notes.get(mine, "excluded")
                outcome.reason = f"our own contribution was rejected ({note}): not applying"
            elif not finite:
                outcome.reason = "average is not finite"
            elif banned:
                outcome.reason = f"a peer we banned was in the group ({', '.join(p[-6:] for p in banned)}): vetoed"
            elif not all_ok:
                outcome.reason = why
            else:
                outcome.ok, outcome.average = True, average
        outcome.round_s = time.monotonic() - t0
        return outcome

    def _agree(self, group_id: str, members: list[str], verdict, evidence: dict,
               checking: bool, lost: list = ()) -> tuple[bool, str, dict]:
        """Publish my verdict for this group (True, False or ABSTAIN; with `checking`, in a record with
        my evidence for the reducer check; with the members that vanished from my part of the round,
        `lost`) and wait for all members' verdicts: the round applies only if none says False and none
        is missing. Returns (ok, why, every member's record)."""
        key = f"{self.cfg.dht_prefix}_verdict_{group_id}"
        value = {"verdict": verdict, **evidence} if checking else verdict
        if verdict is not True:
            if lost:  # the others' parts of the round may have been complete: they learn who vanished here
                value = {**(value if isinstance(value, dict) else {"verdict": verdict}), "lost": list(lost)}
            self._store(key, value)
            return False, "this member's part was incomplete", {}
        found = self._gather(key, value, members, done=lambda v: _verdict(v) is True or _verdict(v) == ABSTAIN,
                             failed=lambda v: _verdict(v) is False)
        if isinstance(found, str):
            return False, found, {}
        return True, "", found

    def _check(self, check: RoundCheck, records: dict) -> dict:
        """The second record of the reducer check: our terms out, every applying member's in."""
        t0 = time.monotonic()
        found = self._gather(f"{self.cfg.dht_prefix}_check_{check.report.group_id}", check.terms(records),
                             check.checkers(), done=check.well_formed, failed=lambda v: False)
        if isinstance(found, str):
            result = {"ok": False, "bad": [], "members": check.members, "stat": 0.0,
                      "missing": found.replace("verdict", "check terms"), "missing_peers": getattr(found, "peers", ())}
        else:
            result = check.verdict(found)
        return {**result, "check_s": time.monotonic() - t0}

    def _store(self, key: str, value) -> None:
        self.dht.store(key, subkey=self.peer_id, value=value,
                       expiration_time=get_dht_time() + 4 * self.cfg.verdict_timeout)

    def _gather(self, key: str, value, members: list, *, done: Callable, failed: Callable) -> dict | str:
        """Store our record under key and wait (verdict_timeout) until every member's is there and
        `done`; returns them (peer id -> value), or why not."""
        self._store(key, value)
        deadline = time.monotonic() + self.cfg.verdict_timeout
        seen: dict[str, Any] = {}
        # members finish within a few tens of ms of each other: read again soon (a late read delays the
        # round, and with the reducer check every member waits for the last one twice), then back off:
        # every DHT read costs ~10 ms of CPU across our processes and p2pd (measured: polling every
        # 50 ms made the background take ~1/3 of a 2-core peer's CPU at one round per second)
        delay = 0.02
        while time.monotonic() < deadline:
            found = self.dht.get(key, latest=True)
            if found is not None and isinstance(found.value, dict):
                seen = {str(k): v.value for k, v in found.value.items()}
            bad = [k for k, v in seen.items() if failed(v)]
            if bad:
                why = Missing(f"member(s) {', '.join(k[-6:] for k in bad)} reported an incomplete round")
                # who vanished from their parts of the round, as they saw it (members of this group only)
                claims = [seen[k].get("lost") if isinstance(seen[k], dict) else None for k in bad]
                why.peers = tuple(sorted({p for c in claims if isinstance(c, (list, tuple)) for p in c
                                          if isinstance(p, str) and p in members}))
                return why
            if all(m in seen and done(seen[m]) for m in members):
                return seen
            time.sleep(delay)
            delay = min(0.25, delay * 1.5)
        why = Missing(f"no verdict within {self.cfg.verdict_timeout}s from member(s) "
                      f"{', '.join(m[-6:] for m in members if m not in seen)}")
        why.peers = tuple(m for m in members if m not in seen)
        return why


def _verdict(value):
    """A member's verdict, from a record with the reducer check's evidence or a bare one."""
    return value.get("verdict") if isinstance(value, dict) else value


def aggregation_of(cfg) -> str:
    """The reducers' rule: per_contribution keeps each member's slot whole, which only a mean does."""
    return cfg.aggregation if cfg.outer_apply == "group" else "mean"


def checks_reducers(cfg) -> bool:
    """int8/int4 replies are rounded by as much as the lies the check would catch: not checked."""
    return cfg.check_reducers and cfg.compression in ("none", "fp16") and cfg.outer_apply == "group"


def weight_ratio(aggregation: str) -> Optional[float]:
    return robust.WEIGHT_RATIO if aggregation == "centered_clip" else None


def contribution_weight(tokens: int, age: int) -> float:
    """Weight of a contribution: tokens processed, gently down-weighted by staleness (FedBuff)."""
    return max(float(tokens), 1.0) / math.sqrt(1.0 + max(age, 0))
