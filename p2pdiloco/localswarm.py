"""A swarm of real `p2pdiloco join` processes on this machine (loopback), for the demo, the
tests, the chaos runner and the benchmarks.

Each peer runs in its own process group, so a test can kill a whole peer (trainer, DHT process,
averager process and p2pd) the way a crashed machine dies, and reap everything at the end.

    >>> with LocalSwarm(workdir, config="peers/tiny-cpu.toml") as swarm:
    ...     swarm.start("a")                     # the first peer writes a.maddrs
    ...     swarm.start("b", join="a")           # joins through a's address
    ...     swarm.wait_for(lambda: len(swarm.events("b", "outer")) >= 2, timeout=120)
    ...     swarm.signal("a", signal.SIGKILL)     # the whole process group
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from p2pdiloco.metrics import read_metrics

# Set by a benchmark's SIGTERM handler (scripts/bench.py), whose swarms wait in worker threads that a
# signal does not reach: every wait below, and the baselines' loops (`raise_if_stopping`), then raise
# KeyboardInterrupt, and each thread unwinds through the `with` or `finally` that stops its peers.
STOPPING = threading.Event()


def raise_if_stopping() -> None:
    if STOPPING.is_set():
        raise KeyboardInterrupt("stopping: SIGTERM")


@dataclass
class PeerProcess:
    name: str
    proc: subprocess.Popen
    log_dir: Path
    maddrs_file: Path
    stderr_path: Path
    args: list = field(default_factory=list)
    reaped: bool = False  # its process group is gone: never signal that group number again

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session=True: the peer leads its own group


def group_members(pgid: int) -> list[int]:
    """Live pids in a process group (read from /proc; zombies excluded)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


class LocalSwarm:
    def __init__(self, workdir: str | Path, *, config: str, extra_args: Sequence[str] = (),
                 env: Optional[dict] = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config = str(config)
        self.extra_args = list(extra_args)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.peers: dict[str, PeerProcess] = {}
        self._stderr_files = []

    def __enter__(self) -> "LocalSwarm":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    # ---------------------------------------------------------------------------- start

    def maddr(self, name: str, timeout: float = 60.0) -> str:
        """The first (loopback) multiaddr that a peer wrote once its DHT was up."""
        path = self.peers[name].maddrs_file
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            raise_if_stopping()
            if path.exists() and path.read_text().strip():
                return path.read_text().split()[0]
            if self.peers[name].proc.poll() is not None:
                raise RuntimeError(f"peer {name} exited with {self.peers[name].proc.returncode}: {self.stderr(name)}")
            time.sleep(0.1)
        raise TimeoutError(f"peer {name} wrote no multiaddr within {timeout}s")

    def start(self, name: str, *args: str, join: Optional[str | Sequence[str]] = None,
              wrapper: Sequence[str] = ()) -> PeerProcess:
        """Start `p2pdiloco join` as peer `name` (again, after a crash: same logs); join = name(s) of
        live peers to bootstrap from; wrapper = a command prefix such as `ip netns exec NS`."""
        log_dir, maddrs_file = self.workdir / name, self.workdir / f"{name}.maddrs"
        cmd = [*wrapper, sys.executable, "-m", "p2pdiloco", "join", "--config", self.config, "--log-dir", str(log_dir),
               "--maddrs-file", str(maddrs_file), *self.extra_args, *args]
        if join:
            names = [join] if isinstance(join, str) else list(join)
            cmd += ["--initial-peers", *[self.maddr(n) for n in names]]
        return self.spawn(name, cmd, args)

    def start_bootstrap(self, name: str = "boot", *, host: str = "127.0.0.1", wrapper: Sequence[str] = ()
                        ) -> PeerProcess:
        """A plain hivemind DHT node that trains nothing: every peer can then start at once and
        join through it (the benchmarks want all peers to begin together)."""
        cmd = [*wrapper, sys.executable, "-m", "p2pdiloco.localswarm", "bootstrap", f"/ip4/{host}/tcp/0",
               str(self.workdir / f"{name}.maddrs")]
        return self.spawn(name, cmd, ())

    def spawn(self, name: str, cmd: list, args: Sequence[str] = ()) -> PeerProcess:
        """Run cmd as `name` in its own process group, stdout and stderr appended to name.stderr; its
        log dir is workdir/name and its multiaddrs file workdir/name.maddrs (any program may use them)."""
        if name in self.peers:
            self.reap(self.peers[name])
        maddrs_file = self.workdir / f"{name}.maddrs"
        maddrs_file.unlink(missing_ok=True)
        stderr_path = self.workdir / f"{name}.stderr"
        stderr = open(stderr_path, "ab")
        self._stderr_files.append(stderr)
        proc = subprocess.Popen(cmd, stdout=stderr, stderr=stderr, stdin=subprocess.DEVNULL, env=self.env,
                                start_new_session=True)
        self.peers[name] = PeerProcess(name, proc, self.workdir / name, maddrs_file, stderr_path, list(args))
        return self.peers[name]

    # ----------------------------------------------------------------------- observe

    def events(self, name: str, event: Optional[str] = None) -> list[dict]:
        path = self.peers[name].log_dir / "metrics.jsonl"
        if not path.exists():
            return []
        records = read_metrics(path)
        return [r for r in records if event is None or r["event"] == event]

    def stderr(self, name: str, tail: int = 2000) -> str:
        path = self.peers[name].stderr_path
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            raise_if_stopping()
            if condition():
                return
            time.sleep(0.25)
        raise TimeoutError(f"{what} not reached within {timeout}s; the peers:\n{self.digest()}")

    def digest(self) -> str:
        """A few lines per peer of what it was doing (for a test's timeout): alive or its exit code,
        outer steps and when the last was, its bans, the last reasons its rounds failed, stderr's end."""
        lines, now = [], time.time()
        for name, peer in self.peers.items():
            try:
                records = self.events(name)
            except Exception as e:  # a line being written: the digest must not hide the timeout
                records, lines = [], [*lines, f"{name}: metrics unreadable ({e})"]
            outer = [r for r in records if r["event"] == "outer"]
            failed = [r.get("reason", "")[:90] for r in records if r["event"] == "round_failed"][-3:]
            banned = [f"{r['sender'][-6:]} ({r['reason']})" for r in records if r["event"] == "banned"]
            state = "alive" if peer.proc.poll() is None else f"exited {peer.proc.returncode}"
            last = (f", last {now - outer[-1]['time']:.0f}s ago (group of {outer[-1].get('group_size')})"
                    if outer else "")
            peer_id = next((r["peer"][-6:] for r in records if r.get("peer")), "?")
            lines.append(f"{name} [{peer_id}] {state}: {len(outer)} outer steps{last}; banned {banned or 'none'}; "
                         f"last failures {failed or 'none'}")
            tail = self.stderr(name, 400).strip().splitlines()[-2:]
            lines += [f"    {line[:200]}" for line in tail]
        return "\n".join(lines)

    # ------------------------------------------------------------------------- stop

    def signal(self, name: str, sig: int, whole_group: bool = True) -> None:
        """Send a signal to a peer: the whole process group (a crashed machine) or the trainer only."""
        peer = self.peers[name]
        if peer.reaped:
            return
        try:
            if whole_group:
                os.killpg(peer.pgid, sig)
            else:
                peer.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def wait_exit(self, name: str, timeout: float) -> int:
        code = self.peers[name].proc.wait(timeout=timeout)
        self.reap(self.peers[name])
        return code

    def stop_all(self, timeout: float = 15.0) -> dict[str, Optional[int]]:
        """SIGTERM every peer, wait, then SIGKILL whatever is left of their process groups."""
        for name, peer in self.peers.items():
            if peer.proc.poll() is None:
                self.signal(name, signal.SIGCONT)  # a frozen peer must be able to stop
                self.signal(name, signal.SIGTERM, whole_group=False)
        deadline = time.monotonic() + timeout
        codes = {}
        for name, peer in self.peers.items():
            try:
                codes[name] = peer.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        for peer in self.peers.values():
            self.reap(peer)
        for f in self._stderr_files:
            f.close()
        self._stderr_files.clear()
        return codes

    @staticmethod
    def reap(peer: PeerProcess) -> None:
        """SIGKILL what is left of a peer's process group, once."""
        if peer.reaped:
            return
        kill_group(peer.proc)
        peer.reaped = True


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left of the process group that proc leads (started with
    start_new_session=True: its DHT process and p2pd included), and reap proc."""
    for pid in group_members(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def _bootstrap_main(host_maddr: str, maddrs_file: str) -> None:
    """Run a DHT node until SIGTERM; its multiaddrs go to maddrs_file."""
    import threading

    import hivemind

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    dht = hivemind.DHT(start=True, host_maddrs=[host_maddr], nat_port_map=False, auto_nat=False)
    try:
        tmp = f"{maddrs_file}.tmp"
        Path(tmp).write_text("".join(f"{a}\n" for a in dht.get_visible_maddrs()))
        os.replace(tmp, maddrs_file)
        stop.wait()
    finally:
        dht.shutdown()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "bootstrap":
        sys.exit("usage: python -m p2pdiloco.localswarm bootstrap HOST_MADDR MADDRS_FILE")
    _bootstrap_main(sys.argv[2], sys.argv[3])
