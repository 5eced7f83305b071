#!/usr/bin/env bash
# Create .venv and install p2pdiloco with its test extras. torch is pinned first so that pip
# takes the CPU build on this kind of machine instead of downloading a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
# Debian packages some tests need: install_deb COMMAND PACKAGE WHO_NEEDS_IT
install_deb() {
    command -v "$1" >/dev/null 2>&1 && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null; } \
            || echo "note: installing $2 failed; $3 needs it"
    else
        echo "note: $3 needs $1: apt-get install $2 (as root, Debian)"
    fi
}
install_deb chromium chromium "tests/test_monitor.py (the monitor's page in headless Chromium)"
install_deb nft nftables "scripts/netns.py's home NATs (tests/test_netns.py, test_internet.py, test_relay_bench.py)"
