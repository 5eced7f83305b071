#!/usr/bin/env bash
# Create .venv and install p2pdiloco with its test extras. torch is pinned first so that pip
# takes the CPU build on this kind of machine instead of downloading a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
# tests/test_monitor.py renders the monitor's page in headless Chromium (Debian's package)
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
            || echo "note: installing chromium failed; tests/test_monitor.py needs it"
    else
        echo "note: tests/test_monitor.py needs chromium: apt-get install chromium (as root, Debian)"
    fi
fi
# scripts/netns.py's home NATs (Namespaces(nat=...), tests/test_netns.py) need nft (Debian's nftables)
if ! command -v nft >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables >/dev/null; } \
            || echo "note: installing nftables failed; the NAT test of tests/test_netns.py needs it"
    else
        echo "note: tests/test_netns.py's NAT test needs nft: apt-get install nftables (as root, Debian)"
    fi
fi
