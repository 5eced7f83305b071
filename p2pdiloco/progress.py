"""Progress bars on stderr for the slow work outside training: the default corpus fetch, the state
download at join, checkpoint writes and reads.

    >>> configure(quiet=args.quiet)                    # once, from the CLI
    >>> with bar("p2pdiloco: writing checkpoint", total=n) as b:
    ...     b.update(len(chunk))
    >>> with ticking(bar("p2pdiloco: downloading the swarm's state", total=None, unit="")):
    ...     blocking_call()                            # no byte count: the elapsed time still moves

Bars are drawn only when stderr is a terminal: a log file or a pipe (a LocalSwarm peer, a service
unit) gets the status lines alone, not a carriage-return redraw every fraction of a second. A bar is
transient: it appears after `delay` seconds (quick work draws nothing) and is erased when done; the
status line printed after the work is the record. `--quiet` turns off bars and status lines alike;
errors still print.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator, Optional

from tqdm import tqdm

_quiet = False
_bars: Optional[bool] = None  # None: when stderr is a terminal
_delay = 0.5


def configure(quiet: bool, *, bars: Optional[bool] = None, delay: float = 0.5) -> None:
    """quiet: no bars and no status lines. bars: force bars on or off (None = when stderr is a
    terminal; tests force them on). delay: seconds before a bar first shows."""
    global _quiet, _bars, _delay
    _quiet, _bars, _delay = quiet, bars, delay


def enabled() -> bool:
    """Whether bars are drawn now."""
    if _quiet:
        return False
    if _bars is not None:
        return _bars
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def note(msg: str) -> None:
    """A status line on stderr, unless quiet."""
    if not _quiet:
        print(msg, file=sys.stderr, flush=True)


def bar(desc: str, *, total: Optional[float] = None, unit: str = "B", bar_format: Optional[str] = None) -> tqdm:
    """A tqdm bar on stderr (bytes by default), or tqdm's no-op when bars are off."""
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=bool(unit), unit_divisor=1024 if unit == "B" else 1000,
                bar_format=bar_format, miniters=0, file=sys.stderr, leave=False, delay=_delay, dynamic_ncols=True,
                disable=not enabled())


@contextlib.contextmanager
def above_bars() -> Iterator[None]:
    """Print status lines in this block while a bar is drawn: the bar steps aside and is redrawn below."""
    with tqdm.external_write_mode(file=sys.stderr):
        yield


@contextlib.contextmanager
def ticking(b: tqdm, every: float = 0.5) -> Iterator[tqdm]:
    """Redraw `b` every `every` seconds while the body blocks, so its elapsed time moves; the bar is
    closed and the redraw thread stopped on exit."""
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(every):
            b.update(0)

    thread = threading.Thread(target=tick, name="p2pdiloco-progress", daemon=True)
    if not b.disable:
        thread.start()
    try:
        yield b
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(timeout=5)
        b.close()
