#!/usr/bin/env python3
"""What the robust rule and the reducer check cost one peer per round, in CPU seconds and bytes, at a
model size (no network: the arithmetic a peer runs, on its own share, as in a real round).

    python scripts/robust_cost.py --params 85e6 --group 4 8 16

Per group size N: a reducer's CenteredClip over its share (params / N values, hivemind's parts of
part_size values, N senders each) against hivemind's running weighted sum of the same parts; the
member's side of the check (its distances, then its projected terms over every piece of the whole
vector: 2 random directions each); the bytes of its two DHT records. Prints one JSON line per N.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack  # noqa: E402  (hivemind's DHT serializer)
import torch  # noqa: E402

from p2pdiloco import robust  # noqa: E402


def measure(params: int, group: int, part_values: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    share = params // group
    parts = max(1, share // part_values)
    generator = torch.Generator().manual_seed(0)
    senders = torch.randn(group, part_values, generator=generator)
    weights = torch.ones(group)
    t0 = time.perf_counter()
    for _ in range(parts):
        total = torch.zeros(part_values)
        for i in range(group):
            total.add_(senders[i], alpha=1.0)
        total.div_(group)
    mean_s = time.perf_counter() - t0
    t0, iterations = time.perf_counter(), 0
    for _ in range(parts):
        iterations += robust.centered_clip(senders, weights).iterations
    clip_s = time.perf_counter() - t0
    # the member's side: distances and terms over every piece of the whole vector
    pieces = max(1, params // part_values)
    own, average = torch.randn(part_values, generator=generator), torch.randn(part_values, generator=generator)
    t0 = time.perf_counter()
    dist = [float((own - average).norm()) for _ in range(pieces)]
    terms = []
    for k in range(pieces):
        z = robust.directions(f"group/{k}".encode(), part_values)
        terms.append(robust.fixed_point_terms(own, average, 1.0, 1.0, z))
    check_s = time.perf_counter() - t0
    record_bytes = len(msgpack.packb({"verdict": True, "nonce": 2**61, "dist": dist})) + len(msgpack.packb(terms))
    return {"params": params, "group": group, "parts_reduced": parts, "part_values": part_values,
            "mean_s": round(mean_s, 3), "centered_clip_s": round(clip_s, 3),
            "mean_iterations": round(iterations / parts, 1), "check_s": round(check_s, 3), "pieces": pieces,
            "check_record_bytes": record_bytes,
            "reducer_memory_mb": round(group * part_values * 4 / 2**20, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=85e6)
    parser.add_argument("--group", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--part-values", type=int, default=2**18,
                        help="values per part (hivemind's 512 KB parts of fp16 transport)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    for group in args.group:
        print(json.dumps(measure(int(args.params), group, args.part_values, args.threads)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
