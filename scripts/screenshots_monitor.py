#!/usr/bin/env python3
"""Take docs/img/monitor.png: `p2pdiloco monitor` watching a real 3-peer tiny swarm on loopback.

    python scripts/screenshots_monitor.py                 # 60 s of training, then the screenshot
    python scripts/screenshots_monitor.py --duration 120 --out /tmp/monitor.png

Needs Debian's chromium (scripts/setup.sh installs it). The peers train on the default corpus
(fetched once into ~/.cache/p2pdiloco) unless `--data` says otherwise. Everything it starts (peers,
monitor, browser) is stopped before it returns.
"""

from __future__ import annotations

import argparse
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2pdiloco.localswarm import LocalSwarm, kill_group  # noqa: E402

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-default-apps", "--no-first-run",
                  "--disable-domain-reliability", "--hide-scrollbars"]


def stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    kill_group(proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of training before the screenshot")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--data", default="", help="corpus for the peers (default: the bundled Shakespeare)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "img" / "monitor.png"))
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        parser.error("chromium is missing: run scripts/setup.sh")

    workdir = Path(tempfile.mkdtemp(prefix="p2pdiloco-shot-"))
    extra = ["--data", args.data] if args.data else []
    names = [chr(ord("a") + i) for i in range(args.peers)]
    monitor = browser = None
    with LocalSwarm(workdir, config=str(ROOT / "peers" / "tiny-cpu.toml"), extra_args=extra) as swarm:
        try:
            swarm.start(names[0])
            for name in names[1:]:
                swarm.start(name, join=names[0])
            monitor = subprocess.Popen(
                [sys.executable, "-m", "p2pdiloco", "monitor", "--initial-peers", swarm.maddr(names[0]),
                 "--config", swarm.config, "--port", "0", "--interval", "2"],
                stdout=subprocess.PIPE, stderr=open(workdir / "monitor.stderr", "wb"), stdin=subprocess.DEVNULL,
                text=True, start_new_session=True)
            if not select.select([monitor.stdout], [], [], 60)[0]:
                raise SystemExit("the monitor printed no URL within 60 s")
            url = monitor.stdout.readline().split()[2]
            print(f"monitor at {url}; training for {args.duration:.0f} s (logs in {workdir})", flush=True)
            time.sleep(args.duration)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            browser = subprocess.Popen(
                [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={workdir / 'chromium'}", "--window-size=1280,900",
                 "--virtual-time-budget=5000", f"--screenshot={Path(args.out).resolve()}", url],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            browser.wait(timeout=60)
            print(f"wrote {args.out}")
        finally:
            for proc in (browser, monitor):
                if proc is not None:
                    stop_group(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
