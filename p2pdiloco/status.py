"""`p2pdiloco status`: the live peers of a run, read from the DHT by a client-only node.

    p2pdiloco status --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3Koo... --run-id tiny
    p2pdiloco status --initial-peers ... --config peers/small-gpu.toml --json

Every peer publishes a progress record every `log_interval` seconds under its run's DHT prefix
(see `swarm.publish_progress`); records expire, so only live peers show. A reader that knows only
the run id first reads the fingerprints the run's peers announced (`swarm.announce_config`), then
the progress key of each. With a run secret the reading node checks the records' HMACs.

`read_swarm` is the reader; `monitor` polls it. Nothing heavy is imported at module level: the
CLI imports this module whenever it builds its parser.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Optional

EXIT_USAGE = 2


# ------------------------------------------------------------------------------ arguments


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `status` and `monitor` share: where to join, which run, how long to wait."""
    parser.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR",
                        help="Multiaddrs of any live peers of the run (or hivemind DHT nodes).")
    parser.add_argument("--config", help="A preset (see peers/): its run_id and run_secret are used.")
    parser.add_argument("--run-id", help="The run to show (default: the preset's, else 'p2pdiloco').")
    parser.add_argument("--run-secret", help="The run's secret, if it has one (better: env P2PDILOCO_RUN_SECRET).")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="S",
                        help="Seconds to reach the initial peers, and for each DHT read (default 10).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser)
    parser.add_argument("--json", action="store_true", help="Print the records as a JSON list instead of a table.")


def client_config(args: argparse.Namespace):
    """A Config for a client-only DHT node: loopback if every initial peer is on loopback."""
    from p2pdiloco.config import Config
    from p2pdiloco.swarm import is_loopback

    if not (math.isfinite(args.timeout) and args.timeout > 0):
        from p2pdiloco.config import ConfigError

        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    local = all(is_loopback(m) for m in args.initial_peers)
    overrides: dict[str, Any] = dict(
        initial_peers=list(args.initial_peers), client_mode=True, identity_path="", announce_maddrs=[],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"] if local else ["/ip4/0.0.0.0/tcp/0"],
        bootstrap_timeout=args.timeout)
    if args.run_id is not None:
        overrides["run_id"] = args.run_id
    if args.run_secret is not None:
        overrides["run_secret"] = args.run_secret
    elif os.environ.get("P2PDILOCO_RUN_SECRET"):
        overrides["run_secret"] = os.environ["P2PDILOCO_RUN_SECRET"]
    return Config.from_sources(args.config, overrides)


def start_client(cfg):
    """The client DHT node (quiet: hivemind's warnings would garble the table)."""
    import logging

    from p2pdiloco import bootstrap

    logging.getLogger("hivemind").setLevel(logging.ERROR)
    return bootstrap.start_dht(cfg)


def fail(message: str) -> int:
    print(f"p2pdiloco: error: {message}", file=sys.stderr)
    return EXIT_USAGE


# ----------------------------------------------------------------------------- reading


def _get(dht, key: str, timeout: float):
    """A DHT read that cannot hang: hivemind's DHT.get has no timeout of its own."""
    import concurrent.futures

    future = dht.get(key, latest=True, return_future=True)
    try:
        return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"DHT read of {key!r} took more than {timeout:.0f}s") from None


def _subkey_values(found) -> dict[str, Any]:
    if found is None or not isinstance(found.value, dict):
        return {}
    return {str(k): v.value for k, v in found.value.items()}


# the fields the table and the dashboard use; any peer of an unsecured run can write a record, so
# these are type-checked (anything else in a record is passed through to --json as it is)
NUMBER_FIELDS = ("outer_step", "inner_step", "loss", "tokens_per_s", "tokens", "group_size", "rounds_applied",
                 "rounds_failed", "eval_loss", "time")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def clean_record(record: dict) -> dict | None:
    """The record with its known fields checked (None where a number is not one); None without a time."""
    if not _is_number(record.get("time")) or not math.isfinite(record["time"]):
        return None
    maddrs = record.get("maddrs")
    banned = record.get("banned")
    banned = {str(k)[:64]: str(v)[:80] for k, v in list(banned.items())[:32]} if isinstance(banned, dict) else {}
    return {**record, "banned": banned,
            **{k: record.get(k) if _is_number(record.get(k)) else None for k in NUMBER_FIELDS},
            "device": str(record.get("device", "?"))[:64],
            "maddrs": [m for m in maddrs if isinstance(m, str)][:8] if isinstance(maddrs, list) else []}


def read_swarm(dht, run_id: str, secret: str = "", *, timeout: float = 10.0) -> list[dict]:
    """The live peers' latest records (progress and status), sorted by peer id; each with `peer` (its id) and
    `fingerprint` (its model config's) added. Raises SwarmError for a missing or wrong secret."""
    from p2pdiloco.secret import public_key, secured_prefix, verifier
    from p2pdiloco.swarm import SwarmError, parse_progress

    verifiers = {v for v in _subkey_values(_get(dht, public_key(run_id), timeout)).values() if isinstance(v, str)}
    if verifiers and not secret:
        raise SwarmError(f"run {run_id!r} is protected: pass its --run-secret (or P2PDILOCO_RUN_SECRET)")
    if verifiers and secret and verifier(secret, run_id) not in verifiers:
        raise SwarmError(f"wrong run secret for run {run_id!r}")
    # the key swarm.announce_config writes: peer id -> fingerprint of its model config
    configs = _subkey_values(_get(dht, f"p2pdiloco_{run_id}_configs", timeout))
    fingerprints = sorted({v for v in configs.values() if isinstance(v, str)})
    peers: dict[str, dict] = {}
    for fp in fingerprints:
        prefix = secured_prefix(secret, run_id, fp) if secret else f"p2pdiloco_{run_id}_{fp}"
        # a live peer's progress record (which expires soon after it stops) over its status record (stored
        # less often: addresses, device, data position, bans; swarm.PROGRESS_FIELDS)
        details = parse_progress(_get(dht, f"{prefix}_status", timeout))
        for peer, record in parse_progress(_get(dht, f"{prefix}_progress", timeout)).items():
            record = clean_record({**details.get(peer, {}), **record})
            if record is not None and record.get("left") is True:  # it stopped cleanly: not a live peer
                peers.pop(peer, None)
                continue
            if record is not None and (peer not in peers or record["time"] > peers[peer]["time"]):
                peers[peer] = {"peer": peer, "fingerprint": fp, **record}
    return [peers[p] for p in sorted(peers)]


def read_data_coverage(dht, records: list[dict], run_id: str, secret: str = "", *,
                       timeout: float = 10.0) -> Optional[dict]:
    """The epoch the live peers read (the oldest among them) and its shards done / claimed / free,
    from the claims records (data/claims.py); None when no peer trains on prepared tokens."""
    from p2pdiloco.data.claims import claims_key, coverage, parse_claims
    from p2pdiloco.secret import secured_prefix

    readers = [r for r in records if isinstance(r.get("data"), dict) and isinstance(r["data"].get("epoch"), int)
               and isinstance(r["data"].get("shards"), int)]
    if not readers:
        return None
    first = min(readers, key=lambda r: r["data"]["epoch"])
    fp, epoch = first["fingerprint"], first["data"]["epoch"]
    prefix = secured_prefix(secret, run_id, fp) if secret else f"p2pdiloco_{run_id}_{fp}"
    claims = parse_claims(_get(dht, claims_key(prefix, epoch), timeout))
    return {"epoch": epoch, "shards": first["data"]["shards"], **coverage(claims, first["data"]["shards"])}


def data_line(cov: Optional[dict]) -> str:
    if cov is None:
        return ""
    return (f"data: epoch {cov['epoch']}, {cov['shards']} shards: {cov['done']} done, {cov['claimed']} claimed, "
            f"{cov['free']} free")


def jsonable(value: Any) -> Any:
    """NaN and infinities -> None, recursively (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


# ---------------------------------------------------------------------------- printing


def address(record: dict, prefer_loopback: bool = False) -> str:
    """The peer's first dialable address, without the /p2p/<peer id> part (the id has its own column)."""
    from p2pdiloco.swarm import is_loopback

    maddrs = [m for m in record.get("maddrs") or [] if isinstance(m, str)]
    loopback = [m for m in maddrs if is_loopback(m)]
    others = [m for m in maddrs if m not in loopback]
    ordered = loopback + others if prefer_loopback else others + loopback
    return ordered[0].split("/p2p/")[0] if ordered else "?"


REACH_MODES = ("direct", "client", "unknown", "local")


def reach(record: dict) -> str:
    """How others reach the peer (reachability.py): direct, client (outbound only), relayed (a client
    that also holds a relay reservation), unknown or local; '?' for a peer that did not say."""
    mode = record.get("reachability")
    if mode not in REACH_MODES:
        return "?"
    relayed = any("p2p-circuit" in m for m in record.get("maddrs") or [] if isinstance(m, str))
    return "relayed" if mode == "client" and relayed else mode


def _num(value: Any, fmt: str) -> str:
    if _is_number(value) and math.isfinite(value):
        return format(value, fmt)
    return "-"


def summary(records: list[dict]) -> dict:
    """Live peers, the swarm's tokens/s (sum over the peers) and the highest outer step."""
    def finite(key: str) -> list:
        return [r[key] for r in records if _is_number(r.get(key)) and math.isfinite(r[key])]

    return {"peers": len(records), "tokens_per_s": sum(finite("tokens_per_s")),
            "outer_step": max(finite("outer_step"), default=0)}


def _data_cell(data: Any) -> str:
    """epoch/shard@cursor of a peer reading prepared tokens (data/claims.py; +N: the other shards it
    reads at once), '-' otherwise."""
    if not isinstance(data, dict) or not all(_is_number(data.get(k)) for k in ("epoch", "shard", "cursor")):
        return "-"
    held = data.get("held")
    more = f"+{len(held) - 1}" if isinstance(held, list) and len(held) > 1 else ""
    return f"e{data['epoch']}/s{data['shard']}@{data['cursor']}{more}"


def format_table(records: list[dict], run_id: str, now: float | None = None, prefer_loopback: bool = False) -> str:
    now = time.time() if now is None else now
    header = ("PEER", "ADDRESS", "REACH", "DEVICE", "OUTER", "INNER", "LOSS", "TOKENS/S", "DATA", "SEEN")
    rows = [(r["peer"], address(r, prefer_loopback), reach(r), str(r.get("device", "?")),
             _num(r.get("outer_step"), "d"), _num(r.get("inner_step"), "d"), _num(r.get("loss"), ".3f"),
             _num(r.get("tokens_per_s"), ",.0f"), _data_cell(r.get("data")),
             f"{max(0.0, now - r['time']):.0f}s ago")
            for r in records]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    right = {4, 5, 6, 7, 9}  # numbers align right

    def line(row) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    s = summary(records)
    lines = [line(header), *(line(row) for row in rows)] if records else [f"no live peers in run {run_id!r}"]
    lines.append(f"{s['peers']} peer(s), swarm {s['tokens_per_s']:,.0f} tokens/s, highest outer step {s['outer_step']}")
    lines += suspect_lines(records)
    return "\n".join(lines)


def suspect_lines(records: list[dict]) -> list[str]:
    """A line per peer that live peers have banned (suspects.py: excluded, clipped hard or a lying
    reducer in most of its rounds with them), most bans first."""
    by_peer: dict[str, list] = {}
    for record in records:
        for peer, why in (record.get("banned") or {}).items():
            by_peer.setdefault(peer, []).append(why)
    return [f"suspect {peer}: banned by {len(whys)} of {len(records)} peer(s) ({max(set(whys), key=whys.count)})"
            for peer, whys in sorted(by_peer.items(), key=lambda item: -len(item[1]))]


# --------------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    from p2pdiloco.config import ConfigError
    from p2pdiloco.swarm import SwarmError, is_loopback

    try:
        cfg = client_config(args)
    except ConfigError as e:
        return fail(str(e))
    dht = None
    try:
        dht = start_client(cfg)
        records = read_swarm(dht, cfg.run_id, cfg.run_secret, timeout=args.timeout)
        cov = read_data_coverage(dht, records, cfg.run_id, cfg.run_secret, timeout=args.timeout)
    except (SwarmError, TimeoutError) as e:
        return fail(str(e))
    finally:
        if dht is not None:
            dht.shutdown()
    if args.json:  # the list of peer records, each with the swarm's data coverage when there is one
        print(json.dumps(jsonable([{**r, "data_coverage": cov} if cov else r for r in records]), indent=2, default=str))
    else:
        print(format_table(records, cfg.run_id, prefer_loopback=all(is_loopback(m) for m in cfg.initial_peers)))
        if cov:
            print(data_line(cov))
    return 0
