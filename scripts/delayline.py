"""The hub of a delayed test network (scripts/netns.py, `Namespaces(delay_ms=...)`): a learning L2
switch between the hub's veth ports that sends every frame `delay_ms` after it arrived. This kernel
has no netem; a packet socket per port does the same in user space (4-8% of a core at 20 Mbit/s,
~20% at 100 Mbit/s, measured). netns.py runs it in the hub namespace as

    python -c "from delayline import delay_line; delay_line(DELAY_S, PARENT_PID, PORTS)"
"""

from __future__ import annotations

import heapq
import itertools
import os
import select
import socket
import sys
import time

_SOL_PACKET, _PACKET_VNET_HDR, _PACKET_IGNORE_OUTGOING = 263, 15, 23
_SO_SNDBUFFORCE, _SO_RCVBUFFORCE = 32, 33
_ETH_P_ALL = 0x0003
_VNET_HDR = 10  # struct virtio_net_hdr in front of every frame
_FRAME_MAX = 1 << 17  # a 64 KB GSO frame plus headers
_BATCH = 64  # frames read from one port before looking at the others and the clock


def delay_line(delay_s: float, parent: int, ports: list[str]) -> None:
    """A learning L2 switch between `ports` that sends every frame delay_s after it arrived.

    Frames keep their virtio-net header (PACKET_VNET_HDR), so checksum-offloaded packets pass intact.
    Sends go through each port's qdisc (the tbf download limit); a full queue drops the frame, as a
    router would. Ends when `parent` does (EOF on stdin, or reparenting)."""
    socks = []
    for name in ports:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)  # protocol 0: receives nothing until bound
        s.setsockopt(_SOL_PACKET, _PACKET_VNET_HDR, 1)
        s.setsockopt(_SOL_PACKET, _PACKET_IGNORE_OUTGOING, 1)  # not our own sends back
        s.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, 8 << 20)
        s.setsockopt(socket.SOL_SOCKET, _SO_SNDBUFFORCE, 8 << 20)
        s.bind((name, _ETH_P_ALL))
        s.setblocking(False)
        socks.append(s)
    port_of = {s.fileno(): k for k, s in enumerate(socks)}
    poller = select.epoll()
    for fd in port_of:
        poller.register(fd, select.EPOLLIN)
    poller.register(sys.stdin.fileno(), select.EPOLLIN)
    where: dict[bytes, int] = {}  # learned source MAC -> port
    queue: list[tuple[float, int, int, bytes]] = []  # heap of (due, seq, out port, frame)
    seq = itertools.count()
    checked = time.monotonic()
    print("ready", flush=True)
    while True:
        wait = min(max(queue[0][0] - time.monotonic(), 0.0), 0.5) if queue else 0.5
        for fd, _ in poller.poll(wait):
            k = port_of.get(fd)
            if k is None:
                if not os.read(fd, 4096):
                    return  # the parent closed its end: it is gone
                continue
            for _ in range(_BATCH):
                try:
                    frame = socks[k].recv(_FRAME_MAX)
                except BlockingIOError:
                    break
                due = time.monotonic() + delay_s
                dst, src = frame[_VNET_HDR:_VNET_HDR + 6], frame[_VNET_HDR + 6:_VNET_HDR + 12]
                where[src] = k
                out = where.get(dst) if not dst[0] & 1 else None  # broadcast/multicast/unknown: flood
                for o in (out,) if out is not None else range(len(socks)):
                    if o != k:
                        heapq.heappush(queue, (due, next(seq), o, frame))
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, o, frame = heapq.heappop(queue)
            try:
                socks[o].send(frame)
            except OSError:  # ENOBUFS: the port's tbf queue is full; EAGAIN: our send buffer is
                pass
        if now - checked > 0.5:
            if os.getppid() != parent:
                return  # reparented: the parent died while something it forked holds the pipe
            checked = now
