"""Batches from a prefetch thread: reading, claiming and fetching shards never stall an inner step.

    >>> feed = DataFeed(lambda: data.train_batch(batch_size, generator), depth=2, pin=True)
    >>> x, y = feed.next()     # waits only when the thread has fallen behind
    >>> feed.close()

The thread calls `produce()` ahead of the training thread, `depth` batches at most, and holds them
in pinned memory on a CUDA peer (so the copy to the GPU is asynchronous). With prepared tokens read
in claimed order, `produce()` is where shards are claimed, finished and fetched from peers (DHT
calls and downloads): all of it happens here. An exception in `produce()` reaches the training
thread at its next `next()`; `Stopped` (a stop while waiting for a shard) ends the feed.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Optional


class DataFeed:
    def __init__(self, produce: Callable[[], tuple], *, depth: int = 2, pin: bool = False,
                 stop_event: Optional[threading.Event] = None):
        self.produce, self.pin = produce, pin
        self.stop_event = stop_event or threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="data-feed", daemon=True)
        self._thread.start()

    def next(self) -> tuple:
        """The next batch; re-raises what produce() raised."""
        while True:
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                if self._closed.is_set() or not self._thread.is_alive():
                    raise RuntimeError("the data feed stopped")
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def close(self, timeout: float = 1.0) -> None:
        self._closed.set()
        while True:  # unblock a put
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=timeout)

    def _put(self, item) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                batch = self.produce()
                if self.pin:
                    batch = tuple(t.pin_memory() for t in batch)
            except BaseException as e:  # handed to the training thread, which decides
                self._put(e)
                return
            if not self._put(batch):
                return
