"""`p2pdiloco plot`: placeholder while it is being written (replaced before this change lands)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    print("p2pdiloco: error: plot is not available yet", file=sys.stderr)
    return 2
