"""The `p2pdiloco` command.

    p2pdiloco join --config peers/tiny-cpu.toml --maddrs-file a.txt            # start a swarm
    p2pdiloco join --config peers/tiny-cpu.toml --initial-peers /ip4/.../p2p/...  # join one
    p2pdiloco join --config peers/tiny-cpu.toml --initial-peers-file a.txt       # ...through a's file
    p2pdiloco status --initial-peers /ip4/.../p2p/... --run-id tiny               # live peers
    p2pdiloco monitor --initial-peers /ip4/.../p2p/... --run-id tiny --port 8080  # live dashboard
    p2pdiloco plot runs/a runs/b -o swarm.png                                     # metrics plots

Every config key is also a flag (`inner_steps` -> `--inner-steps`); flags override the preset.
Bad input (a flag, a config key, a data path, a multiaddr, initial peers that still do not answer
after bootstrap_timeout, or that belong to another run) gives one line on stderr and exit code 2;
it names the address and why (refused, timed out, wrong peer id, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

from p2pdiloco.config import Config, ConfigError, help_for

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage dump
        print(f"p2pdiloco: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML preset (see peers/); flags override its keys.")
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        # argparse %-formats help texts: a literal % in a key's help must not break --help
        kw: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS, help=help_for(f.name).replace("%", "%%"))
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif isinstance(default, list):
            parser.add_argument(flag, nargs="*", metavar="MADDR", **kw)
        else:
            parser.add_argument(flag, type=type(default), metavar=type(default).__name__.upper(), **kw)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="p2pdiloco", description="Decentralized DiLoCo training over a hivemind swarm.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    join = sub.add_parser("join", help="Start or join a swarm and train.")
    _add_config_flags(join)
    join.add_argument("--quiet", action="store_true", help="No status lines on stderr.")
    join.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                      help="Level of library logs on stderr (hivemind included).")
    # the operator commands live in their own modules: each adds its flags and runs
    for name, module, help in OPERATOR_COMMANDS:
        importlib.import_module(module).add_arguments(sub.add_parser(name, help=help))
    return parser


OPERATOR_COMMANDS = [
    ("status", "p2pdiloco.status", "Print the live peers of a run (joins the DHT as a client only)."),
    ("monitor", "p2pdiloco.monitor", "Serve a live web dashboard of a run."),
    ("plot", "p2pdiloco.plot", "Plot the metrics of one or more --log-dir directories into a PNG."),
    ("prepare", "p2pdiloco.data.prepare", "Tokenize text into token shards and a manifest for join --data."),
    ("export", "p2pdiloco.export", "Write a checkpoint's anchor as a transformers model directory."),
    ("sample", "p2pdiloco.sample", "Print continuations of a prompt from a checkpoint or a live swarm."),
]


def resolve_config(args: argparse.Namespace) -> Config:
    overrides = {k: v for k, v in vars(args).items() if k in {f.name for f in dataclasses.fields(Config)}}
    if "run_secret" not in overrides and os.environ.get("P2PDILOCO_RUN_SECRET"):
        overrides["run_secret"] = os.environ["P2PDILOCO_RUN_SECRET"]
    return Config.from_sources(args.config, overrides)


def _setup_logging(level: str) -> None:
    # hivemind logs through its own handler on the "hivemind" logger; its child processes are
    # forked from this one and inherit the level
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("hivemind").setLevel(getattr(logging, level.upper()))


def cmd_join(args: argparse.Namespace) -> int:
    from p2pdiloco.checkpoint import CheckpointError
    from p2pdiloco.data import DataError
    from p2pdiloco.peer import Peer
    from p2pdiloco.progress import configure
    from p2pdiloco.swarm import SwarmError

    cfg = resolve_config(args)
    _setup_logging(args.log_level)
    configure(quiet=args.quiet)
    try:
        if cfg.log_dir:
            Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
            (Path(cfg.log_dir) / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    except OSError as e:
        print(f"p2pdiloco: error: log dir {cfg.log_dir} is not writable: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        Peer(cfg, quiet=args.quiet).run()
    except (DataError, SwarmError, CheckpointError) as e:
        print(f"p2pdiloco: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("p2pdiloco: interrupted", file=sys.stderr)
        return 130
    return 0


def _test_clock_step() -> None:
    """Tests and benchmarks only: P2PDILOCO_TEST_CLOCK_STEP="PATH:S" steps the wall clock of this
    process S seconds once the file PATH exists (looked for every 0.1 s), as NTP or a suspended
    machine does (every peer of a run on this machine stepped 16 s forward once), the monotonic
    clock untouched. Set before hivemind is imported, so that its DHT times step too, and inherited
    by the DHT and averager processes, which look for the file themselves."""
    spec = os.environ.get("P2PDILOCO_TEST_CLOCK_STEP", "")
    if not spec:
        return
    import time

    path, _, step = spec.rpartition(":")
    step = float(step)
    real, seen = time.time, {"stepped": False, "next": 0.0}

    def stepped() -> float:
        now = real()
        if not seen["stepped"] and now >= seen["next"]:
            seen["stepped"], seen["next"] = os.path.exists(path), now + 0.1
        return now + step if seen["stepped"] else now

    time.time = stepped


def main(argv: Optional[list[str]] = None) -> int:
    _test_clock_step()
    args = build_parser().parse_args(argv)
    try:
        if args.command == "join":
            code = cmd_join(args)
        else:
            module = next(m for name, m, _ in OPERATOR_COMMANDS if name == args.command)
            code = importlib.import_module(module).run(args)
    except ConfigError as e:
        print(f"p2pdiloco: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    # Everything we started is stopped by now (Peer.close in its finally). Skip the interpreter's
    # teardown: with hivemind's and torch's threads still parked, it sometimes aborts the process
    # ("terminate called without an active exception", exit -6) after a clean stop.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
