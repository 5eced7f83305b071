"""The anchor's held-out evaluation, in a background thread: the training thread only asks for it.

    >>> ev = Evaluator(evaluate, budget=0.01, on_result=report)
    >>> ev.request(outer_step)     # after an applied outer step: returns at once
    >>> ev.final()                 # at the end: waits for one in flight, then evaluates here
    >>> ev.close()

`evaluate()` reads the anchor under the peer's state lock (on the CPU its forward passes run on
views of the live anchor, so the round's thread waits to move it; on a GPU only the copy to the
device holds the lock). Requests made while one runs count as one, run after it; a request is
dropped while the evaluations so far took more than `budget` of the wall time since the evaluator
started: at 88.6M on a CPU one evaluation takes seconds, and with the default budget (1%) the
anchor is evaluated about once per hundred times that. After a whole round every member holds the
same anchor, so the swarm learns nothing new from each member evaluating it; each peer still
evaluates its own (its status line, its `final` record), within its budget.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)


class Evaluator:
    def __init__(self, evaluate: Callable[[], tuple[Optional[float], int]], *, budget: float,
                 on_result: Callable[[int, Optional[float], float], None]):
        """evaluate() -> (held-out loss or None, the outer step of the anchor it evaluated);
        on_result(outer_step, loss, seconds), from the evaluating thread."""
        self.evaluate, self.budget, self.on_result = evaluate, budget, on_result
        self.spent_s = 0.0  # seconds evaluating, background and final
        self.count = 0
        self._started = time.monotonic()
        self._wake = threading.Condition()
        self._asked: Optional[int] = None
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="evaluator", daemon=True)
        self._thread.start()

    def request(self, outer_step: int) -> bool:
        """Evaluate the anchor soon (True: after the one running, if any; requests made meanwhile count
        as one), or not at all (False: over budget)."""
        with self._wake:
            over = self.budget > 0 and self.spent_s > self.budget * (time.monotonic() - self._started)
            if self._closed or over:
                return False
            self._asked = outer_step
            self._wake.notify()
            return True

    def final(self, timeout: float = 60.0) -> Optional[float]:
        """The last evaluation, in the caller's thread, after the one in flight (if any) ended."""
        deadline = time.monotonic() + timeout
        with self._wake:
            self._asked = None  # the final evaluation covers it
            while self._busy and time.monotonic() < deadline:
                self._wake.wait(0.1)
            self._busy = True
        try:
            return self._run()
        finally:
            with self._wake:
                self._busy = False

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout=1.0)

    def _run(self) -> Optional[float]:
        t0 = time.perf_counter()
        loss, outer_step = self.evaluate()
        seconds = time.perf_counter() - t0
        self.spent_s += seconds
        self.count += 1
        self.on_result(outer_step, loss, seconds)
        return loss

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._asked is None and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                asked, self._asked, self._busy = self._asked, None, True
            try:
                self._run()
            except Exception as e:  # an evaluation that fails costs its result, not the peer
                logger.warning(f"evaluation asked at outer step {asked} failed: {e!r}")
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()
