"""Benchmarks only (`scale.py swarm --dht-breakdown`): with this directory on PYTHONPATH and
DHTCOUNT_DIR set, every process that imports hivemind's DHT counts the bytes of the DHT RPCs its
node serves (request + response protobufs, by RPC and by key) and the names of the keys it reads
and stores, and writes them to DHTCOUNT_DIR/<pid>.json every 3 s. Each RPC is counted once, where it
is served; `scale.dht_breakdown` sums the files. Nothing happens without DHTCOUNT_DIR."""

import os

if os.environ.get("DHTCOUNT_DIR"):
    import builtins
    import collections
    import functools
    import json
    import sys
    import time

    _DIR = os.environ["DHTCOUNT_DIR"]
    _state = {"last": 0.0, "installed": False}
    _bytes = collections.Counter()  # "rpc|key id" -> bytes (split evenly over a request's keys)
    _calls = collections.Counter()  # rpc -> calls served
    _names = {}                     # key name -> key id (the first 16 hex digits of its DHTID)

    def _dump() -> None:
        now = time.time()
        if now - _state["last"] > 3.0:
            _state["last"] = now
            path = os.path.join(_DIR, f"{os.getpid()}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({"bytes": dict(_bytes), "calls": dict(_calls), "names": _names}, f)
            os.replace(path + ".tmp", path)

    def _count_served(orig, rpc):
        @functools.wraps(orig)  # hivemind registers handlers by their type annotations
        async def served(self, request, context):
            response = await orig(self, request, context)
            size = request.ByteSize() + (response.ByteSize() if response is not None else 0)
            keys = [k.hex()[:16] for k in getattr(request, "keys", [])] or ["-"]
            for key in keys:
                _bytes[f"{rpc}|{key}"] += size / len(keys)
            _calls[rpc] += 1
            _dump()
            return response
        return served

    def _name_keys(orig):
        @functools.wraps(orig)
        async def named(self, keys, *args, **kwargs):
            from hivemind.dht.routing import DHTID

            for key in keys:
                if isinstance(key, str) and key not in _names:
                    _names[key] = DHTID.generate(source=key).to_bytes().hex()[:16]
            return await orig(self, keys, *args, **kwargs)
        return named

    def _install(protocol, node) -> None:
        for rpc in ("rpc_find", "rpc_store", "rpc_ping"):
            setattr(protocol.DHTProtocol, rpc, _count_served(getattr(protocol.DHTProtocol, rpc), rpc))
        for method in ("get_many", "store_many"):
            setattr(node.DHTNode, method, _name_keys(getattr(node.DHTNode, method)))

    _import = builtins.__import__

    def _hook(name, *args, **kwargs):
        module = _import(name, *args, **kwargs)
        if not _state["installed"] and name.startswith("hivemind"):
            protocol, node = sys.modules.get("hivemind.dht.protocol"), sys.modules.get("hivemind.dht.node")
            if hasattr(protocol, "DHTProtocol") and hasattr(node, "DHTNode"):
                _state["installed"] = True  # first: _install's own imports come back through this hook
                _install(protocol, node)
        return module

    builtins.__import__ = _hook
