"""Shared fixtures: a small learnable corpus written by the test (no download), the tiny preset,
and a session-wide reaper for any p2pd daemon a test leaves behind."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "peers" / "tiny-cpu.toml")
# for hivemind DHTs a test starts itself: loopback only, and no UPnP/NAT-PMP or AutoNAT traffic
LOOPBACK_DHT = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False)


def _orphan_p2pd_pids() -> set[int]:
    """p2pd daemons whose owner (a DHT process) is gone: reparented to init."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/comm").read_text().strip() != "p2pd":
                    continue
                stat = Path(f"/proc/{entry}/stat").read_text()
                state, ppid = stat[stat.rfind(")") + 2:].split()[:2]
                if state != "Z" and int(ppid) == 1:
                    pids.add(int(entry))
            except (OSError, ValueError):
                continue
    return pids


def group_left(pgid: int, timeout: float = 10.0) -> list[int]:
    """The live members of a process group once they are all gone, or at the deadline: a process
    that was just signalled or whose parent just exited takes a moment to die on two busy cores."""
    from p2pdiloco.localswarm import group_members

    deadline = time.monotonic() + timeout
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(scope="session", autouse=True)
def reap_p2pd():
    """Kill p2pd daemons orphaned during the session (other swarms on the machine are left alone;
    each test's LocalSwarm reaps its own peers' process groups)."""
    before = _orphan_p2pd_pids()
    yield
    for pid in _orphan_p2pd_pids() - before:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def evaluated(outer: list[dict]) -> list[dict]:
    """The `outer` records whose anchor was evaluated: the evaluation runs in a background thread, so a
    live peer's newest outer steps may not have their loss yet (and some steps are never evaluated)."""
    return [r for r in outer if r.get("eval_loss") is not None]


def make_corpus(path: Path, size: int = 300_000, seed: int = 0) -> Path:
    """Sentences from a small grammar: learnable in a minute, so a falling loss is visible."""
    rng = random.Random(seed)
    subjects = ["the king", "a fool", "my lord", "the queen", "good sir", "the ghost", "our army", "fair maid"]
    verbs = ["speaks", "weeps", "fights", "sleeps", "laughs", "rides", "prays", "sings"]
    objects = ["at dawn", "in the hall", "for honour", "with the sword", "by the sea", "to the crown"]
    lines = []
    total = 0
    while total < size:
        line = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}.\n"
        lines.append(line)
        total += len(line)
    path.write_text("".join(lines))
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("data") / "corpus.txt")
