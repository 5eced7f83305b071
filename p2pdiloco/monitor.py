"""`p2pdiloco monitor`: a live web dashboard of a run, served from a client-only DHT node.

    p2pdiloco monitor --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3Koo... --run-id tiny --port 8080
    # then open http://127.0.0.1:8080/

A background thread reads the peers' progress records (`status.read_swarm`) every `--interval`
seconds and keeps a bounded history per peer; a stdlib HTTP server serves one self-contained page
(`dashboard.html`: inline JS and SVG, no external URLs) and its data at `/api/swarm`. The page
fetches the data every few seconds: the live peers, loss curves, outer steps and group sizes per
peer, and the swarm's tokens/s. Records arrive once per peer per `log_interval`, so polling faster
than that adds nothing. The server binds 127.0.0.1 by default: it has no authentication, so pass
`--host 0.0.0.0` only on a network you trust.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Optional

from p2pdiloco.status import add_run_arguments, address, fail, jsonable, summary

logger = logging.getLogger(__name__)

POINT_KEYS = ("loss", "eval_loss", "outer_step", "group_size", "tokens_per_s", "rounds_applied", "rounds_failed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser)
    parser.add_argument("--port", type=int, default=8080, help="HTTP port (0 = any free port; default 8080).")
    parser.add_argument("--host", default="127.0.0.1",
                        help="Address to serve on (default 127.0.0.1; the page has no authentication).")
    parser.add_argument("--interval", type=float, default=5.0, metavar="S",
                        help="Seconds between two reads of the DHT (default 5).")
    parser.add_argument("--history", type=int, default=720, metavar="N",
                        help="Points kept per peer and for the swarm (default 720: an hour at 5 s).")


class SwarmWatch:
    """Reads the swarm every `interval` seconds in a thread and keeps a bounded history.

        >>> watch = SwarmWatch(dht, "tiny", "", interval=5, timeout=10)
        >>> watch.poll()              # one read now (raises on a missing or wrong secret)
        >>> watch.start(); ...; watch.stop()
        >>> watch.snapshot()          # what /api/swarm serves
    """

    def __init__(self, dht, run_id: str, secret: str, *, interval: float, timeout: float, max_points: int = 720,
                 max_peers: int = 256, prefer_loopback: bool = False):
        self.dht, self.run_id, self.secret = dht, run_id, secret
        self.interval, self.timeout = interval, timeout
        self.max_points, self.max_peers = max_points, max_peers
        self.prefer_loopback = prefer_loopback
        self.lock = threading.Lock()
        self.live: list[dict] = []
        self.history: OrderedDict[str, deque] = OrderedDict()  # peer id -> points, first seen first
        self.swarm: deque = deque(maxlen=max_points)
        self.last_poll: Optional[float] = None
        self.error: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def poll(self) -> None:
        from p2pdiloco.status import read_swarm

        records = read_swarm(self.dht, self.run_id, self.secret, timeout=self.timeout)
        now = time.time()
        with self.lock:
            self.live, self.last_poll, self.error = records, now, None
            for r in records:
                points = self.history.get(r["peer"])
                if points is None:
                    if len(self.history) >= self.max_peers:  # forget the peer heard from longest ago
                        del self.history[min(self.history, key=lambda p: self.history[p][-1]["time"])]
                    points = self.history[r["peer"]] = deque(maxlen=self.max_points)
                if not points or points[-1]["time"] != r["time"]:  # a new record, not the same one again
                    points.append({"time": r["time"], **{k: r[k] for k in POINT_KEYS}})
            s = summary(records)
            self.swarm.append({"time": now, "peers": s["peers"], "tokens_per_s": s["tokens_per_s"],
                               "outer_step": s["outer_step"]})

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception as e:  # keep serving the last data; the page shows the error
                logger.warning(f"reading the swarm failed: {e}")
                with self.lock:
                    self.error = str(e) or type(e).__name__

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="swarm-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling; returns once no DHT read of ours is in flight (or after the read timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout * 4 + 5)

    def snapshot(self) -> dict:
        now = time.time()
        with self.lock:
            peers = [{**r, "address": address(r, self.prefer_loopback), "age_s": max(0.0, now - r["time"])}
                     for r in self.live]
            return jsonable({
                "run_id": self.run_id, "now": now, "interval": self.interval, "last_poll": self.last_poll,
                "error": self.error, "summary": summary(self.live), "peers": peers,
                "history": [{"peer": p, "points": list(points)} for p, points in self.history.items()],
                "swarm": list(self.swarm)})


def make_server(host: str, port: int, watch: SwarmWatch):
    """A ThreadingHTTPServer bound to host:port serving the page and /api/swarm (not started)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    page = (Path(__file__).with_name("dashboard.html")).read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", page)
            elif path == "/api/swarm":
                body = json.dumps(watch.snapshot(), allow_nan=False, default=str).encode()
                self._send(200, "application/json", body)
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found\n")

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:
            logger.debug("%s " + format, self.address_string(), *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def run(args: argparse.Namespace) -> int:
    import signal

    from p2pdiloco.config import ConfigError
    from p2pdiloco.status import client_config, start_client
    from p2pdiloco.swarm import SwarmError, is_loopback

    if not 0 <= args.port <= 65535:
        return fail(f"--port must be in 0-65535, got {args.port}")
    if not (math.isfinite(args.interval) and args.interval > 0):
        return fail(f"--interval must be a positive number of seconds, got {args.interval}")
    if args.history < 2:
        return fail(f"--history must be >= 2, got {args.history}")
    try:
        cfg = client_config(args)
    except ConfigError as e:
        return fail(str(e))

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    watch = SwarmWatch(None, cfg.run_id, cfg.run_secret, interval=args.interval, timeout=args.timeout,
                       max_points=args.history, prefer_loopback=all(is_loopback(m) for m in cfg.initial_peers))
    server = server_thread = None
    try:
        try:
            server = make_server(args.host, args.port, watch)
        except (OSError, OverflowError) as e:
            return fail(f"cannot serve on {args.host}:{args.port}: {getattr(e, 'strerror', None) or e}")
        # the page comes up at once; it shows "connecting" until the first read
        server_thread = threading.Thread(target=server.serve_forever, kwargs=dict(poll_interval=0.2),
                                         name="monitor-http", daemon=True)
        server_thread.start()
        host, port = server.server_address[:2]
        print(f"p2pdiloco monitor: http://{host}:{port}/ (run {cfg.run_id!r}; Ctrl-C stops)", flush=True)
        try:
            watch.dht = start_client(cfg)
            watch.poll()  # a missing or wrong secret shows here
        except SwarmError as e:
            return fail(str(e))
        except Exception as e:  # a slow or failed first read is not fatal: the thread retries
            watch.error = str(e) or type(e).__name__
        watch.start()
        stop.wait()
        return 0
    finally:
        watch.stop()
        if server is not None:
            if server_thread is not None:
                server.shutdown()
            server.server_close()
        if watch.dht is not None:
            watch.dht.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
