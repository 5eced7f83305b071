"""hivemind's control pipes, made safe for large messages sent from several threads.

hivemind's DHT and averager each run in a child process that reads its end of a multiprocessing
pipe on a uvloop event loop, after `loop.add_reader`, which makes that end non-blocking. Two
hivemind 1.1.12 traps follow, and both kill the child (measured: a 3-way merge round of the 85M
preset, whose reducer-check records are ~20 KB, killed the DHT process of 2 of 3 peers;
`scripts/scale.py peers --size real --away 45`; reproduced without p2pdiloco by 4 threads storing
27 KB values, tests/test_pipes.py):

- the child reads a message whose bytes have not all arrived (one larger than the pipe's atomic
  write, 4 KB): `recv` fails with EAGAIN mid-message, and the next read unpickles the rest;
- the parent's threads (the round thread's verdicts and checks, the main thread's progress records,
  the claims) send at once, and `Connection.send` writes a message over 16 KB as two writes: another
  thread's message can land between them.

SafePipe reads and writes with the descriptor blocking for the call, and sends under a lock. The
child's event loop only polls the descriptor, so that loop sees no difference.
"""

from __future__ import annotations

import contextlib
import os
import threading
from multiprocessing.reduction import ForkingPickler


class SenderGone(ConnectionRefusedError):
    """A message that carries a pipe end (hivemind's futures), read after its sender exited (a run's
    end): the pipe end cannot be rebuilt. An OSError, which hivemind's loops log and skip (and
    averaging.quiet_expected_events drops); before, the EOFError of this case killed the DHT process."""


class SafePipe:
    """A multiprocessing Connection whose send and recv each move one whole message."""

    def __init__(self, conn):
        self._conn = conn
        self._send_lock, self._recv_lock = threading.Lock(), threading.Lock()

    def send(self, obj) -> None:
        with self._send_lock, _blocking(self._conn.fileno()):
            self._conn.send(obj)

    def recv(self):
        with self._recv_lock, _blocking(self._conn.fileno()):
            message = self._conn.recv_bytes()
        try:
            return ForkingPickler.loads(message)
        except (EOFError, OSError) as e:  # the message is read whole: the pipe stays in step
            raise SenderGone(f"a message whose sender has exited: {e!r}") from e

    def __getattr__(self, name):  # fileno, poll, close, closed, ...
        return getattr(self._conn, name)


@contextlib.contextmanager
def _blocking(fd: int):
    was = os.get_blocking(fd)
    if not was:
        os.set_blocking(fd, True)
    try:
        yield
    finally:
        if not was:
            os.set_blocking(fd, False)


def guard_pipes(process) -> None:
    """Wrap a hivemind DHT's or DecentralizedAverager's control pipes; call before its process starts."""
    process._inner_pipe = SafePipe(process._inner_pipe)
    process._outer_pipe = SafePipe(process._outer_pipe)
