"""Shards fetched from peers: a volunteer needs only the manifest of a prepared directory.

Every peer training on prepared tokens announces the shards it holds whole (their sha256 checked):
one DHT record per peer under `{prefix}_shards`, a bitmap over the manifest's train shards then
its held-out shards, stored again when it changes (after a fetch) or half its life has passed,
expiring max(30 s, 4 log intervals) after. A shard this peer claims and does not hold is fetched from the peers that announce it with
the state download's scheme (state.py): chunks of up to CHUNK_BYTES, IN_FLIGHT requests per source
at once, up to MAX_SOURCES sources, a failed chunk handed to the others. The chunks are written
into a temp file in the cache (`shard_cache`), the whole file is checked against the manifest's
sha256, then renamed into place, so that the cache holds only whole shards.

A holder whose bytes are wrong (a bad disk, a bad actor) is found by the checksum: the shard is
fetched again from one source at a time, the first whole copy names the sources whose chunks
differed from it, and those are never asked again (the caller logs each once). A shard that no
live peer holds is not claimed (claims.py skips it: it stays free for later, or for a holder).

The cache is bounded (`shard_cache_gb`): before a fetch, the least recently used fetched shards
go, never the ones being read. The serving side and the fetching side run in the averager
process, which holds the p2p handlers (ShardSharing, a mixin of DilocoAverager, as StateSharing);
the trainer asks it through `fetch_shard` (blocking) and announces holdings with `announce`.

    >>> source = ShardSource(data, averager, dht, cfg, peer_id)   # data: a TokenData
    >>> source.announce()                  # at start, every log interval, after each fetch
    >>> source.ready(index)                # a train shard here (fetched if some peer holds it)?
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import math
import os
import time
from pathlib import Path
from typing import AsyncIterator, Optional

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture

from p2pdiloco.state import MAX_SOURCES, MESSAGE_BYTES, answer, ask_averager, run_workers

logger = logging.getLogger(__name__)

CHUNK_BYTES = 2**23  # 8 MB per request at most, as a state download's
HOLDERS_CACHE_S = 5.0  # the trainer reads the holders record at most this often


def holders_key(prefix: str) -> str:
    return f"{prefix}_shards"


def encode_held(held: set[int], n: int) -> str:
    """A bitmap over the manifest's n shards (train, then held-out), as hex."""
    bits = bytearray((n + 7) // 8)
    for i in held:
        bits[i // 8] |= 1 << (i % 8)
    return bits.hex()


def decode_held(value, n: int) -> set[int]:
    try:
        bits = bytes.fromhex(value)
    except (TypeError, ValueError):
        return set()
    return {i for i in range(min(n, 8 * len(bits))) if bits[i // 8] >> (i % 8) & 1}


def parse_holders(found, n: int) -> dict[str, set[int]]:
    """peer id -> the shard indices it holds, from a DHT get of the holders key."""
    if found is None or not isinstance(found.value, dict):
        return {}
    out = {}
    for peer, entry in found.value.items():
        held = decode_held(getattr(entry, "value", None), n)
        if held and isinstance(peer, str):
            out[peer] = held
    return out


class ShardCache:
    """A folder of whole shards fetched from peers, at most `limit` bytes."""

    def __init__(self, root: str | Path, limit: int):
        self.root = Path(root)
        self.limit = int(limit)

    def path(self, name: str) -> Path:
        return self.root / name

    def make_room(self, size: int, keep: set[str]) -> list[str]:
        """Delete the least recently used shards (not in `keep`) until `size` more bytes fit; their names."""
        self.root.mkdir(parents=True, exist_ok=True)
        files = [f for f in self.root.iterdir() if f.is_file() and not f.name.startswith(".")]
        used = sum(f.stat().st_size for f in files)
        evicted = []
        for f in sorted(files, key=lambda f: f.stat().st_mtime):
            if used + size <= self.limit:
                break
            if f.name in keep:
                continue
            used -= f.stat().st_size
            f.unlink(missing_ok=True)
            evicted.append(f.name)
        return evicted


class _HolderGone(Exception):
    """A holder failed or does not serve the shard: its chunks go to the others."""


class ShardSharing:
    """The averager's half (a mixin of DilocoAverager): serve byte ranges of the shards we hold
    whole; fetch a shard from its holders into the cache. Needs `_shard_files` (name -> (path,
    size), whole shards only), `_shard_cache` (a ShardCache or None) and `_is_run_member`."""

    # ------------------------------------------------------------------ serving (averager process)

    async def rpc_shard_chunk(self, request: averaging_pb2.DownloadData, context: P2PContext
                              ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Bytes [start, stop) of a shard we hold, after a header {"size": ...}."""
        if not await self._is_run_member(context, "shard download"):
            yield averaging_pb2.DownloadData(metadata=self.serializer.dumps({"error": "not a member"}))
            return
        try:
            ask = self.serializer.loads(request.metadata)
            name, start, stop = str(ask["file"]), int(ask["start"]), int(ask["stop"])
            path, size = self._shard_files[name]
            if not 0 <= start <= stop <= size or stop - start > CHUNK_BYTES:
                raise ValueError(f"range [{start}, {stop})")
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), stop - start, start)
            if len(data) != stop - start:
                raise OSError(f"{name} is shorter than {size} bytes")
        except Exception as e:  # not ours, a bad request, a file gone: answer, keep serving
            yield averaging_pb2.DownloadData(metadata=self.serializer.dumps({"error": f"{e!r}"[:200]}))
            return
        yield averaging_pb2.DownloadData(metadata=self.serializer.dumps({"size": size}))
        view = memoryview(data)
        for offset in range(0, len(data), MESSAGE_BYTES):
            yield averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=bytes(view[offset:offset +
                                                                                            MESSAGE_BYTES])))

    # ------------------------------------------------------------------ fetching (host process)

    def fetch_shard(self, name: str, *, index: int, size: int, sha256: str, n_shards: int, keep: set[str],
                    timeout: float, stop_event=None) -> dict:
        """Fetch shard `name` (its place `index` among the manifest's `n_shards`) from its holders
        into the cache (blocking, at most `timeout` s). A dict: ok, reason, path, seconds, bytes
        (per source), evicted (names removed from the cache), corrupt (sources caught)."""
        ask = dict(name=name, index=index, size=size, sha256=sha256, n_shards=n_shards, keep=set(keep), timeout=timeout)
        return ask_averager(self, "_fetch_shard_task", ask, timeout=timeout, stop_event=stop_event)

    # ------------------------------------------------------------------ fetching (averager process)

    async def _fetch_shard_task(self, future: MPFuture, timeout: float, **ask) -> None:
        await answer(future, self._fetch_shard(**ask), timeout, "shard fetch")

    async def _fetch_shard(self, name: str, index: int, size: int, sha256: str, n_shards: int,
                           keep: set[str]) -> dict:
        t0 = time.monotonic()
        banned = self._shard_banned
        found = await asyncio.wait_for(self.dht.get(holders_key(self._cfg.dht_prefix), latest=True,
                                                    return_future=True), timeout=self.request_timeout)
        holders = [peer for peer, held in parse_holders(found, n_shards).items()
                   if index in held and peer != str(self.peer_id) and peer not in banned][:MAX_SOURCES]
        if not holders:
            return {"ok": False, "reason": "no live peer holds it"}
        lookup_s = time.monotonic() - t0
        cache: ShardCache = self._shard_cache
        evicted = cache.make_room(size, keep)
        for gone in evicted:
            self._shard_files.pop(gone, None)
        part, other = cache.path(f".{name}.part"), cache.path(f".{name}.check")
        received: dict[str, int] = collections.Counter()
        corrupt: list[str] = []
        try:
            chunk = max(2**15, min(CHUNK_BYTES, math.ceil(size / (4 * len(holders)))))
            by_chunk, digest = await self._fetch_file(part, name, holders, size, chunk, received)
            if by_chunk is None:
                return {"ok": False, "reason": "every holder left or failed during the fetch", "evicted": evicted}
            good = part
            if digest != sha256:
                # someone served wrong bytes: one source at a time; the first whole copy names the culprits
                good, mixed = None, set(by_chunk.values())
                for source in holders:
                    if len(mixed) == 1 and source in mixed:
                        continue  # it alone served the bad copy
                    alone, digest = await self._fetch_file(other, name, [source], size, chunk, received)
                    if alone is None:
                        continue
                    if digest == sha256:
                        good = other
                        break
                    corrupt.append(source)
                if good is None and len(mixed) == 1:
                    corrupt.extend(mixed)
                elif good is not None:
                    corrupt.extend(_differing(part, good, by_chunk, chunk))
                banned.update(corrupt)
                if good is None:
                    return {"ok": False, "reason": "no holder served bytes matching the manifest's sha256",
                            "corrupt": sorted(set(corrupt)), "evicted": evicted}
            path = cache.path(name)
            os.replace(good, path)
            self._shard_files[name] = (str(path), size)
            return {"ok": True, "path": str(path), "seconds": time.monotonic() - t0, "lookup_s": lookup_s,
                    "bytes": dict(received), "corrupt": sorted(set(corrupt)), "evicted": evicted}
        finally:
            part.unlink(missing_ok=True)
            other.unlink(missing_ok=True)

    async def _fetch_file(self, path: Path, name: str, sources: list[str], size: int, chunk: int,
                          received: collections.Counter) -> tuple[Optional[dict[int, str]], str]:
        """Every chunk of the file from `sources` into `path`: (chunk index -> its source, the
        file's sha256), or (None, "") when the sources all failed first. The chunks are hashed in
        order as they land, in a thread, while the later ones stream."""
        n_chunks = max(1, math.ceil(size / chunk))
        chunks = collections.deque(range(n_chunks))
        by_chunk: dict[int, str] = {}
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        hasher, hashed, hashing = hashlib.sha256(), [0], asyncio.Lock()
        loop = asyncio.get_running_loop()

        def hash_chunk(i: int) -> None:
            hasher.update(os.pread(fd, min(size, (i + 1) * chunk) - i * chunk, i * chunk))

        async def advance() -> None:
            async with hashing:
                while hashed[0] in by_chunk:
                    await loop.run_in_executor(None, hash_chunk, hashed[0])
                    hashed[0] += 1

        pending: list[asyncio.Task] = []
        try:
            async def request(peer: PeerID, source: str, i: int) -> None:
                start, stop = i * chunk, min(size, (i + 1) * chunk)
                await self._shard_request(peer, fd, name, start, stop)
                by_chunk[i] = source
                received[source] += stop - start
                if i == hashed[0]:
                    pending.append(asyncio.create_task(advance()))

            gone = await run_workers(sources, chunks, n_chunks, lambda: len(by_chunk), request)
            await asyncio.gather(*pending)
            if len(by_chunk) == n_chunks:
                await advance()
        finally:
            for task in pending:
                task.cancel()
            os.close(fd)
        for source, why in gone.items():
            logger.info(f"shard holder {source[-6:]} dropped ({why}); its chunks went to the others")
        return (by_chunk, hasher.hexdigest()) if len(by_chunk) == n_chunks else (None, "")

    async def _shard_request(self, peer: PeerID, fd: int, name: str, start: int, stop: int) -> None:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        ask = self.serializer.dumps({"file": name, "start": start, "stop": stop})
        stream = await stub.rpc_shard_chunk(averaging_pb2.DownloadData(metadata=ask))
        header, offset = None, start
        async for message in aiter_with_timeout(stream, timeout=self.next_chunk_timeout or self.request_timeout):
            if message.metadata:
                header = self.serializer.loads(message.metadata)
                if not isinstance(header, dict) or "error" in header:
                    raise _HolderGone(str(header)[:200])
            data = message.tensor_part.buffer
            if data:
                if header is None or offset + len(data) > stop:
                    raise _HolderGone("bytes outside the requested range")
                os.pwrite(fd, data, offset)
                offset += len(data)
        if header is None or offset != stop:
            raise _HolderGone(f"stream ended after {offset - start} of {stop - start} bytes")


def _differing(bad: Path, good: Path, by_chunk: dict[int, str], chunk: int) -> list[str]:
    """The sources of the chunks where `bad` and `good` differ."""
    out = set()
    with open(bad, "rb") as a, open(good, "rb") as b:
        for i, source in sorted(by_chunk.items()):
            if os.pread(a.fileno(), chunk, i * chunk) != os.pread(b.fileno(), chunk, i * chunk):
                out.add(source)
    return sorted(out)


class ShardSource:
    """The trainer's half: which shards are here, which a live peer holds, and fetching the rest.

    `data` is the TokenData (its `paths` are the shards here); `averager` a DilocoAverager with
    ShardSharing. `ready(index)` is what claims.py asks before claiming a train shard."""

    def __init__(self, data, averager, dht, cfg, peer_id: str, *, stop_event=None, report=None, say=None):
        self.data, self.averager, self.dht, self.cfg, self.peer_id = data, averager, dht, cfg, peer_id
        self.stop_event = stop_event
        self.report = report or (lambda **_: None)  # the peer's metrics: one "fetch" event per fetch
        self.say = say or logger.warning  # what the user sees once (a holder caught)
        self.shards = data.manifest.train + data.manifest.val
        self.place = {s.file: i for i, s in enumerate(self.shards)}
        self._holders: dict[str, set[int]] = {}
        self._holders_at = -math.inf
        self.caught: set[str] = set()  # holders that served wrong bytes, reported once each
        self.ttl = max(30.0, 4 * cfg.log_interval)
        self._announced: tuple = (None, -math.inf)  # (what, when) we last stored

    def announce(self, held: Optional[set[int]] = None) -> None:
        """Our holdings under our peer id (an empty bitmap at a clean stop), stored when they changed
        or half the record's life has passed (called every log interval). A client (behind NAT,
        reachability.py) takes no incoming requests: it fetches, and announces nothing."""
        if getattr(self.averager, "client_mode", False):
            return
        held = {self.place[f] for f in self.data.paths} if held is None else held
        value = encode_held(held, len(self.shards))
        if value == self._announced[0] and time.monotonic() - self._announced[1] < self.ttl / 2:
            return
        self._announced = (value, time.monotonic())
        future = self.dht.store(holders_key(self.cfg.dht_prefix), subkey=self.peer_id, value=value,
                                expiration_time=get_dht_time() + self.ttl, return_future=True)
        try:
            future.result(timeout=self.cfg.request_timeout)
        except Exception as e:  # the next renewal stores it again
            future.cancel()
            logger.warning(f"announcing our shards did not finish: {e!r}")

    def holders(self) -> dict[str, set[int]]:
        if time.monotonic() - self._holders_at > HOLDERS_CACHE_S:
            future = self.dht.get(holders_key(self.cfg.dht_prefix), latest=True, return_future=True)
            try:
                self._holders = parse_holders(future.result(timeout=self.cfg.request_timeout), len(self.shards))
            except Exception as e:
                future.cancel()
                logger.warning(f"no answer about which peers hold shards: {e!r}")
            self._holders.pop(self.peer_id, None)
            self._holders_at = time.monotonic()
        return self._holders

    def held_elsewhere(self, place: int) -> bool:
        return any(place in held for peer, held in self.holders().items() if peer not in self.caught)

    def here(self, index: int) -> bool:
        return self.data.manifest.train[index].file in self.data.paths

    def available(self, index: int) -> bool:
        """Train shard `index` is here or held by a live peer (nothing is fetched)."""
        shard = self.data.manifest.train[index]
        return shard.file in self.data.paths or self.held_elsewhere(self.place[shard.file])

    def ready(self, index: int) -> bool:
        """Train shard `index` (its place in the manifest) is here, or was just fetched."""
        return self.get(self.data.manifest.train[index])

    def get(self, shard, *, timeout: Optional[float] = None) -> bool:
        """Shard `shard` (train or held-out) is here, or was just fetched from its holders."""
        here = self.data.paths.get(shard.file)
        if here is not None:
            if here.parent == self.data.cache:
                os.utime(here)  # the cache evicts the least recently used
            return True
        place = self.place[shard.file]
        if not self.held_elsewhere(place):
            return False  # nobody holds it now: claimed again later
        keep = set(self.data.reading()) | {s.file for s in self.data.manifest.val}
        size = shard.tokens * self.data.dtype.itemsize
        result = self.averager.fetch_shard(shard.file, index=place, size=size, sha256=shard.sha256,
                                           n_shards=len(self.shards), keep=keep,
                                           timeout=timeout or self.cfg.state_timeout, stop_event=self.stop_event)
        for name in result.get("evicted", []):
            self.data.forget(name)
        for source in result.get("corrupt", []):
            if source not in self.caught:
                self.caught.add(source)
                self.say(f"p2pdiloco: peer {source} served bytes of {shard.file} that do not match the "
                         f"manifest's sha256: not asking it for shards again")
        self.report(shard=shard.file, ok=bool(result.get("ok")), seconds=result.get("seconds"),
                    lookup_s=result.get("lookup_s"),
                    bytes=result.get("bytes"), corrupt=result.get("corrupt") or None,
                    evicted=result.get("evicted") or None,
                    reason=None if result.get("ok") else result.get("reason"))
        if not result.get("ok"):
            logger.info(f"fetching {shard.file} failed: {result.get('reason')}")
            self._holders_at = -math.inf
            return False
        self.data.add(shard.file, Path(result["path"]))
        self.announce()
        return True
