#!/usr/bin/env bash
# Create .venv and install p2pdiloco with its test extras. torch is pinned first so that pip
# takes the CPU build on this kind of machine instead of downloading a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
