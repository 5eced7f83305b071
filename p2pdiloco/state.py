"""The outer state a peer shares with joiners, and its download from several peers at once.

Shared state = anchor and outer momentum (fp32, 2N values) in one shared-memory buffer
(`SharedState`) that the trainer writes and the averager process reads: a download is served
straight from it, with no copy of the model per request and without asking the trainer (which
may be busy in a step or a round). A sequence number in shared memory (a seqlock) tells a reader
whether the trainer changed the state while a chunk was copied; the state's `version` is its
outer step and a hash of sampled anchor and momentum values (`state_id`), so that a joiner can
take the chunks of one state from every peer that holds the same one.

A joiner (`StateSharing._download_state`, in its averager process): reads who shares state from
hivemind's `.all_averagers` record, asks each for its version (a header: a chunk of 0 values),
picks the newest state held by the most peers, and fetches chunks of it from all of them at once,
two requests in flight per source. A source that fails or whose state moved on is dropped and its
chunks go to the others; if all are gone the joiner looks again. The chunks land in the averager's
round buffer (idle between rounds), and the trainer validates them and copies them into its live
state (`download_state`). hivemind#169 asked for this: every newcomer downloading from one peer.

    >>> loaded = download_state(averager, cfg, numel, timeout=30)   # None if nobody shares state
    >>> loaded.outer_step, loaded.anchor, loaded.sources
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import ctypes
import hashlib
import logging
import math
import mmap
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional

import numpy as np
import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.timed_storage import ValueWithExpiration

from p2pdiloco import diloco
from p2pdiloco.progress import above_bars, bar, ticking

logger = logging.getLogger(__name__)

MESSAGE_BYTES = 2**20      # one streamed message: hivemind's default of 64 KiB made a download ~10x slower
MAX_CHUNK_VALUES = 2**21   # 8 MB per request; smaller for small states so that every source gets work
IN_FLIGHT = 2              # requests per source at once: the next chunk is asked for while one streams
MAX_SOURCES = 8


@dataclass
class LoadedState:
    """The swarm's state as a download (or a merge round) brought it: checked, not yet ours."""

    outer_step: int
    anchor: torch.Tensor
    momentum: torch.Tensor
    download_s: float = 0.0
    sources: list = field(default_factory=list)  # peer ids the chunks came from


class SharedState:
    """anchor | momentum in one buffer (shared memory: the averager process serves it), and
    [seq, outer_step, state_id] beside it. Every change happens inside `writing()`."""

    def __init__(self, numel: int, *, shared: bool = True):
        self.numel = numel
        self.buf = torch.zeros(2 * numel)
        self.meta = torch.zeros(3, dtype=torch.int64)
        if shared:
            self.buf.share_memory_()
            self.meta.share_memory_()
        self.anchor, self.momentum = self.buf[:numel], self.buf[numel:]

    @contextlib.contextmanager
    def writing(self):
        """seq is odd while the state changes: a chunk copied meanwhile is discarded by its reader."""
        self.meta[0] += 1
        try:
            yield
        finally:
            self.meta[0] += 1

    def publish(self, outer_step: int, digest_idx: torch.Tensor) -> None:
        self.meta[1] = int(outer_step)
        self.meta[2] = state_id(self.anchor, self.momentum, digest_idx)

    def read(self) -> tuple[int, int, int]:
        seq, outer_step, sid = (int(v) for v in self.meta.tolist())
        return seq, outer_step, sid


_MADV_REMOVE = 9  # Linux: free the shared-memory pages of a range; reading them again gives zeros


def all_finite(t: torch.Tensor, chunk: int = 1 << 18) -> bool:
    """torch.isfinite(t).all(), 262,144 values at a time: on a CPU, isfinite makes an abs() copy and
    two masks of the whole tensor, 1.5x its size (0.53 GB for an 88.6M anchor, seen at every round's
    end in the 85M peers' memory; docs/scale.md)."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + chunk]).all()) for i in range(0, flat.numel(), chunk))


def release_pages(tensor: torch.Tensor) -> None:
    """Return the whole pages of a shared-memory tensor to the system (they read as zeros after). A
    no-op where madvise is not available: the memory then simply stays in use."""
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, end // page * page
    if hi <= lo or not tensor.is_shared():
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_REMOVE)
    except (OSError, AttributeError) as e:
        logger.debug(f"madvise unavailable: {e!r}")


def state_id(anchor: torch.Tensor, momentum: torch.Tensor, idx: torch.Tensor) -> int:
    """A 63-bit hash of sampled anchor and momentum values: peers with the same id hold the same state."""
    sampled = torch.cat([anchor[idx], momentum[idx]]).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(sampled, digest_size=8).digest(), "little") >> 1


def make_metadata(cfg, outer_step: int) -> dict:
    return {"outer_step": int(outer_step), "fingerprint": cfg.fingerprint(), "run_id": cfg.run_id}


def validate_state(metadata, tensors, cfg, numel: int) -> LoadedState:
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
        if not all_finite(t):
            raise ValueError(f"{name} is not finite")
    return LoadedState(outer_step=outer_step, anchor=anchor, momentum=momentum)


def _valid_digest(digest, size: int) -> bool:
    """A header's anchor digest as ours would be: `size` finite floats (anything else from a peer
    would break the comparison of sources, and the peer is simply not used)."""
    return (isinstance(digest, list) and len(digest) == size
            and all(isinstance(v, float) and math.isfinite(v) for v in digest))


def ask_averager(averager, method: str, kwargs: dict, *, timeout: float, stop_event=None) -> dict:
    """Run `method` (a coroutine taking `future`) in the averager process and wait for its dict:
    at most timeout + 5 s, and returning soon after stop_event is set."""
    future = MPFuture()
    averager._outer_pipe.send((method, [], dict(future=future, **kwargs)))
    deadline = time.monotonic() + timeout + 5.0
    while time.monotonic() < deadline:
        if stop_event is not None and stop_event.is_set():
            future.cancel()
            return {"ok": False, "reason": "stopped"}
        try:
            return future.result(timeout=0.25)
        except (TimeoutError, concurrent.futures.TimeoutError):
            continue
    future.cancel()
    return {"ok": False, "reason": f"no answer within {timeout:.0f}s"}


async def answer(future: MPFuture, work, timeout: float, what: str) -> None:
    """In the averager process: await `work` (a coroutine giving a dict) for at most `timeout` s and
    set its dict on `future`; a timeout or a failure is {"ok": False, "reason": ...}, never an
    exception in the averager's loop."""
    try:
        result = await asyncio.wait_for(work, timeout=timeout)
    except asyncio.TimeoutError:
        result = {"ok": False, "reason": f"not complete within {timeout:.0f}s"}
    except Exception as e:  # report, never kill the averager's loop
        logger.debug(f"{what} failed", exc_info=True)
        result = {"ok": False, "reason": f"{type(e).__name__}: {e}"[:300]}
    if not future.done():
        future.set_result(result)


async def run_workers(sources: list[str], chunks: collections.deque, n_chunks: int, done: Callable[[], int],
                      request: Callable) -> dict[str, str]:
    """IN_FLIGHT workers per source take chunk indices from `chunks` and `await request(peer, source,
    index)` until done() reaches n_chunks; a failed chunk goes back in the queue for the others and
    its source is dropped. Returns the dropped sources: peer id -> why."""
    gone: dict[str, str] = {}

    async def worker(source: str) -> None:
        peer = PeerID.from_base58(source)
        while done() < n_chunks and source not in gone:
            if not chunks:  # others hold the last chunks: take one back if its source fails
                if all(s in gone for s in sources if s != source):
                    return
                await asyncio.sleep(0.005)  # short: the transfer ends when the last chunk lands
                continue
            index = chunks.popleft()
            try:
                await request(peer, source, index)
            except Exception as e:
                chunks.append(index)
                gone.setdefault(source, f"{type(e).__name__}: {e}"[:200])
                return

    # interleaved: every source's first worker takes a chunk before any source's second
    await asyncio.gather(*(worker(s) for _ in range(IN_FLIGHT) for s in sources))
    return gone


class _SourceGone(Exception):
    """A source failed, or its state is no longer the one we fetch: its chunks go to the others."""


class StateSharing:
    """The averager's half (a mixin of DilocoAverager): serve chunks of our SharedState, fetch
    chunks of the swarm's state from several peers into `staging`. Needs `_shared` (SharedState or
    None), `_cfg`, `staging` (a 2N view that nothing uses between rounds) and `_is_run_member`."""

    # ------------------------------------------------------------------ serving (averager process)

    async def rpc_state_chunk(self, request: averaging_pb2.DownloadData, context: P2PContext
                              ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Values [start, stop) of our anchor | momentum, with our version in the first message; a
        request of 0 values gets the version only. {"moved": ...} when the state is not the one asked for."""
        shared = self._shared
        if shared is None or not self.allow_state_sharing or not await self._is_run_member(context, "state download"):
            yield averaging_pb2.DownloadData(metadata=self.serializer.dumps({"error": "not sharing state"}))
            return
        try:
            ask = self.serializer.loads(request.metadata)
            start, stop, want = int(ask["start"]), int(ask["stop"]), ask.get("state_id")
            if not 0 <= start <= stop <= 2 * shared.numel or stop - start > MAX_CHUNK_VALUES:
                raise ValueError(f"range [{start}, {stop})")
        except Exception as e:  # a malformed request: answer, keep serving
            yield averaging_pb2.DownloadData(metadata=self.serializer.dumps({"error": f"bad request: {e}"[:200]}))
            return
        seq, outer_step, sid = shared.read()
        header = {"outer_step": outer_step, "state_id": sid, "numel": shared.numel,
                  "fingerprint": self._cfg.fingerprint(), "run_id": self._cfg.run_id}
        if stop == start:  # a header: the digest lets the joiner see which sources agree
            header["digest"] = diloco.anchor_digest(shared.anchor, diloco.digest_indices(shared.numel))
        if seq % 2 or (want is not None and want != sid) or shared.read()[0] != seq:
            yield averaging_pb2.DownloadData(metadata=self.serializer.dumps({**header, "moved": True}))
            return
        data = shared.buf[start:stop].numpy().tobytes()
        if shared.read()[0] != seq:  # the trainer wrote meanwhile: this copy may be torn
            yield averaging_pb2.DownloadData(metadata=self.serializer.dumps({**header, "moved": True}))
            return
        yield averaging_pb2.DownloadData(metadata=self.serializer.dumps(header))
        view = memoryview(data)
        for offset in range(0, len(data), MESSAGE_BYTES):
            part = runtime_pb2.Tensor(buffer=bytes(view[offset:offset + MESSAGE_BYTES]))
            yield averaging_pb2.DownloadData(tensor_part=part)

    # ------------------------------------------------------------------ fetching (host process)

    def download_state(self, *, timeout: float, min_outer_step: int = 0, stop_event=None) -> dict:
        """Fetch the swarm's newest state into `staging` (blocking, at most `timeout` seconds, and
        returning soon after stop_event is set). A dict: ok, reason, outer_step, metadata, sources..."""
        return ask_averager(self, "_download_state", dict(timeout=timeout, min_outer_step=min_outer_step),
                            timeout=timeout, stop_event=stop_event)

    # ------------------------------------------------------------------ fetching (averager process)

    async def _download_state(self, future: MPFuture, timeout: float, min_outer_step: int) -> None:
        await answer(future, self._fetch_state(min_outer_step, future), timeout, "state download")

    async def _fetch_state(self, min_outer_step: int, future: MPFuture) -> dict:
        t0 = time.monotonic()
        total = self.staging.numel()
        done: set[int] = set()
        target = None  # (outer_step, state_id) whose chunks are in `done`
        received: dict[str, int] = collections.Counter()
        reason = "no peer shares state"
        while not future.done():
            headers = await self._headers()
            usable = {peer: h for peer, h in headers.items() if h.get("numel") == total // 2
                      and h.get("fingerprint") == self._cfg.fingerprint() and h.get("run_id") == self._cfg.run_id}
            if headers and not usable:
                reason = "the peers that share state are of another run or model config"
            newest = max((h["outer_step"] for h in usable.values()), default=-1)
            if newest < max(min_outer_step, 0):
                if usable:
                    reason = f"no peer offers outer step {min_outer_step} yet"
                return {"ok": False, "reason": reason}
            reference, sources = self._agreeing(usable, newest)
            if target is None or target[0] != newest or not self._agree(target[1], reference):
                # another state: start over (chunks of different states must not be mixed)
                target, done = (newest, reference), set()
                chunk = max(2**14, min(MAX_CHUNK_VALUES, math.ceil(total / (4 * len(sources)))))
            chunks = collections.deque(i for i in range(math.ceil(total / chunk)) if i not in done)
            await self._fetch_chunks({p: usable[p]["state_id"] for p in sources}, chunks, chunk, done, received)
            if len(done) == math.ceil(total / chunk):
                return {"ok": True, "outer_step": newest, "seconds": time.monotonic() - t0,
                        "sources": sorted(received), "bytes": dict(received),
                        "metadata": make_metadata(self._cfg, newest)}
            reason = "every source left or moved on during the download"
            await asyncio.sleep(0.5)
        return {"ok": False, "reason": "cancelled"}

    def _agree(self, a: list, b: list) -> bool:
        return diloco.digest_spread(a, b) <= self._cfg.anchor_tolerance

    def _agreeing(self, headers: dict, outer_step: int) -> tuple[list, list[str]]:
        """The digest at `outer_step` that the most sources agree with, and those sources. Members of
        one group hold anchors equal up to the transport's rounding, as in every round: chunks of
        such sources are mixed the same way."""
        at_step = {p: h["digest"] for p, h in headers.items() if h["outer_step"] == outer_step}
        reference = max(at_step.values(), key=lambda d: sum(self._agree(d, other) for other in at_step.values()))
        return reference, [p for p, d in at_step.items() if self._agree(d, reference)][:MAX_SOURCES]

    async def _headers(self) -> dict[str, dict]:
        """The version of every peer that announces state sharing (highest outer step first)."""
        found = await self.dht.get(f"{self._matchmaking.group_key_manager.prefix}.all_averagers", latest=True,
                                   return_future=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        peers = [PeerID(key) for key, info in sorted(
            entries.items(), key=lambda kv: -kv[1].value if isinstance(kv[1].value, (int, float)) else 0)
            if isinstance(info, ValueWithExpiration) and isinstance(info.value, (int, float))]
        peers = [p for p in peers if p != self.peer_id][:4 * MAX_SOURCES]

        async def ask(peer: PeerID) -> Optional[dict]:
            try:
                header, _ = await asyncio.wait_for(self._request(peer, 0, 0, None), timeout=self.request_timeout)
                return header
            except Exception as e:  # gone, unreachable, an old version: not a source
                logger.debug(f"no state header from {peer}: {e!r}")
                return None

        answers = await asyncio.gather(*(ask(p) for p in peers))
        size = len(diloco.digest_indices(self.staging.numel() // 2))
        return {str(p): h for p, h in zip(peers, answers) if isinstance(h, dict) and "moved" not in h
                and isinstance(h.get("outer_step"), int) and isinstance(h.get("state_id"), int)
                and _valid_digest(h.get("digest"), size)}

    async def _fetch_chunks(self, sources: dict[str, int], chunks: collections.deque, chunk: int,
                            done: set, received: collections.Counter) -> None:
        """Fetch `chunks` from the sources (peer id -> the state_id it had: a source whose state
        changes since is dropped); a failed chunk goes back in the queue for the others."""
        total = self.staging.numel()

        async def request(peer: PeerID, source: str, index: int) -> None:
            start, stop = index * chunk, min(total, (index + 1) * chunk)
            _, nbytes = await self._request(peer, start, stop, sources[source])
            done.add(index)
            received[source] += nbytes

        gone = await run_workers(list(sources), chunks, math.ceil(total / chunk), lambda: len(done), request)
        for source, why in gone.items():
            logger.info(f"state source {source[-6:]} dropped ({why}); its chunks went to the others")

    async def _request(self, peer: PeerID, start: int, stop: int, sid: Optional[int]) -> tuple[dict, int]:
        """One request: the header, and values [start, stop) written into staging. Raises _SourceGone."""
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        ask = self.serializer.dumps({"start": start, "stop": stop, "state_id": sid})
        stream = await stub.rpc_state_chunk(averaging_pb2.DownloadData(metadata=ask))
        header, offset = None, start
        target = self.staging.numpy()
        async for message in aiter_with_timeout(stream, timeout=self.next_chunk_timeout or self.request_timeout):
            if message.metadata:
                header = self.serializer.loads(message.metadata)
                if not isinstance(header, dict) or "error" in header or (stop > start and header.get("moved")):
                    raise _SourceGone(str(header)[:200])
            data = message.tensor_part.buffer
            if data:
                values = np.frombuffer(data, dtype=np.float32)
                if header is None or offset + len(values) > stop:
                    raise _SourceGone("values outside the requested range")
                target[offset:offset + len(values)] = values
                offset += len(values)
        if header is None or offset != stop:
            raise _SourceGone(f"stream ended after {offset - start} of {stop - start} values")
        return header, (stop - start) * 4


def download_state(averager, cfg, numel: int, *, timeout: float, min_outer_step: int = 0, progress=None,
                   stop_event=None) -> Optional[LoadedState]:
    """Download the newest outer state from every peer that holds it, retrying until `timeout`.

    min_outer_step: wait until some peer offers at least this outer step (a member that left a round
    diverged waits for the others to apply it). Returns None if no usable state came in time (or
    on stop_event). The returned tensors are views of the averager's idle round buffer: copy them
    before the next round starts."""
    shown = bar("p2pdiloco: downloading the swarm's state", unit="", bar_format="{desc}: {elapsed}{postfix}")
    with ticking(shown):
        return _download(averager, cfg, numel, timeout=timeout, min_outer_step=min_outer_step, progress=progress,
                         stop_event=stop_event, shown=shown)


def _download(averager, cfg, numel: int, *, timeout: float, min_outer_step: int, progress, stop_event,
              shown) -> Optional[LoadedState]:
    deadline = time.monotonic() + timeout
    attempt = 0
    while stop_event is None or not stop_event.is_set():
        attempt += 1
        shown.set_postfix_str(f"attempt {attempt}" if min_outer_step <= 0 else
                              f"attempt {attempt}, waiting for outer step {min_outer_step}", refresh=False)
        t0 = time.monotonic()
        result = averager.download_state(timeout=max(1.0, min(cfg.state_timeout, deadline - t0)),
                                         min_outer_step=min_outer_step, stop_event=stop_event)
        if result.get("ok"):
            staging = averager.staging
            try:
                loaded = validate_state(result["metadata"], [staging[:numel], staging[numel:]], cfg, numel)
                loaded.download_s, loaded.sources = time.monotonic() - t0, result["sources"]
                return loaded
            except ValueError as e:
                logger.warning(f"rejected a downloaded state: {e}")
        else:
            logger.info(f"state download attempt {attempt}: {result.get('reason')}")
        if time.monotonic() + 0.5 >= deadline:
            return None
        if progress is not None and attempt == 1:
            with above_bars():
                progress(f"p2pdiloco: no state yet ({result.get('reason', 'rejected')}), retrying ...")
        if stop_event is not None:
            stop_event.wait(0.25 if min_outer_step > 0 else 1.0)
        else:
            time.sleep(0.25 if min_outer_step > 0 else 1.0)
    return None
