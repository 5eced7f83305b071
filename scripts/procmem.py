"""Memory of a peer's processes, counted so that shared pages are not counted twice.

A `p2pdiloco join` peer is four processes in one process group: the trainer, the averager
process and the DHT process (both forked by hivemind) and the DHT's `p2pd`. Their RSS counts
pages they share (copy-on-write after a fork, shared-memory tensors) once per process, so the
sum overstates what the peer holds. PSS splits every shared page among the processes that map
it; summed over all processes of the machine it is the memory in use. USS counts private pages
only.

    >>> roles = peer_roles(pgid)           # {"trainer": pid, "averager": pid, "dht": pid, "p2pd": pid}
    >>> sample(roles)["trainer"]["pss_mb"]
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable

from p2pdiloco.localswarm import group_members

FIELDS = {"Rss": "rss_mb", "Pss": "pss_mb", "Pss_Anon": "pss_anon_mb", "Pss_Shmem": "pss_shmem_mb",
          "Private_Clean": "_private_clean", "Private_Dirty": "_private_dirty"}


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rfind(")") + 2:].split()[1])


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def peer_roles(pgid: int) -> dict[str, int]:
    """The role of each live process of a peer's group: the trainer leads the group, p2pd is the
    daemon, its parent is the DHT process, and the trainer's other child is the averager."""
    roles: dict[str, int] = {}
    pids = group_members(pgid)
    try:
        comms = {pid: _comm(pid) for pid in pids}
        p2pd = [pid for pid, comm in comms.items() if comm == "p2pd"]
        if pgid in comms:
            roles["trainer"] = pgid
        if p2pd:
            roles["p2pd"] = p2pd[0]
            roles["dht"] = _parent(p2pd[0])
        others = [pid for pid in pids if pid not in roles.values() and comms[pid] != "p2pd"
                  and _parent(pid) == pgid]
        if others:
            roles["averager"] = others[0]
    except (OSError, ValueError):  # a process ended while we looked: the next sample sees the group anew
        pass
    return roles


def memory_of(pid: int) -> dict:
    """PSS, its anonymous and shared-memory parts, RSS and USS of one process, in MB (empty if gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return {}
    values = {}
    for line in text.splitlines()[1:]:
        key, _, rest = line.partition(":")
        if key in FIELDS:
            values[FIELDS[key]] = int(rest.split()[0]) / 1024
    values["uss_mb"] = values.pop("_private_clean", 0.0) + values.pop("_private_dirty", 0.0)
    return values


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def sample(roles: dict[str, int]) -> dict[str, dict]:
    """Memory and open file descriptors of each role's process now."""
    out = {}
    for role, pid in roles.items():
        memory = memory_of(pid)
        if memory:
            out[role] = {**memory, "fds": open_fds(pid), "pid": pid}
    return out


class Every:
    """Calls take() every `every` seconds in a daemon thread, until the with block ends.

        >>> with Every(lambda: samples.append(sample(peer_roles(pgid))), 60.0):
        ...     run_the_swarm()
    """

    def __init__(self, take: Callable[[], None], every: float, *, first_at_once: bool = False):
        self.take, self.every, self.first_at_once = take, every, first_at_once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)

    def __enter__(self) -> "Every":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        if self.first_at_once:
            self.take()
        while not self._stop.wait(self.every):
            self.take()
