"""Seconds inside inner steps, without a device sync per step.

    >>> timer = StepTimer(device)
    >>> timer.start(); loss = step(); step_s = timer.stop()
    >>> timer.total_s          # all steps whose end the device has reached

On the CPU a step's wall time. On CUDA the GPU's own time from the step's first kernel to its
last, from a pair of events recorded in the stream and read once the GPU has passed them (a step
or more later): `torch.cuda.synchronize` after every step would leave the GPU idle while the CPU
queues the next one. stop() returns the CPU's time for the step call (on CUDA, its launch time).
"""

from __future__ import annotations

import collections
import time

import torch


class StepTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.total_s = 0.0
        self._t0 = 0.0
        self._start = None
        self._open: collections.deque = collections.deque()  # (start, end) events the GPU may not have reached

    def start(self) -> None:
        self._t0 = time.perf_counter()
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def stop(self) -> float:
        seconds = time.perf_counter() - self._t0
        if not self.cuda:
            self.total_s += seconds
            return seconds
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._open.append((self._start, end))
        self.drain()
        return seconds

    def drain(self, wait: bool = False) -> float:
        """Count the steps the GPU has finished (wait: all of them); the total so far."""
        while self._open and (wait or self._open[0][1].query()):
            start, end = self._open.popleft()
            end.synchronize()
            self.total_s += start.elapsed_time(end) / 1000
        return self.total_s
