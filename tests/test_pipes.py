"""hivemind's DHT process and large records stored from several threads at once (pipes.py): a real
DHT in its real child process. Without the guard (hivemind 1.1.12's pipes) this same load kills the
child within seconds (`_pickle.UnpicklingError` or `EOFError` in DHT._run), and the storing threads
then block on the full pipe: the test fails on its deadline."""

from __future__ import annotations

import threading
import time

import hivemind
import pytest
from hivemind.utils.timed_storage import get_dht_time

from p2pdiloco.pipes import guard_pipes

THREADS, STORES = 4, 60
RECORD = [float(i) for i in range(3000)]  # ~27 KB pickled: a reducer-check record of a merge round at 85M


@pytest.mark.timeout(120)
def test_large_records_from_several_threads_keep_the_dht_alive():
    dht = hivemind.DHT(start=False, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    guard_pipes(dht)
    dht.run_in_background(await_ready=True, timeout=60)
    errors: list = []

    def worker(k: int) -> None:
        try:
            for i in range(STORES):
                dht.store(f"key{k}", subkey=f"s{i % 5}", value=RECORD, expiration_time=get_dht_time() + 60,
                          return_future=True)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(THREADS)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "stores blocked: the DHT process stopped reading"
        time.sleep(1.0)  # the child unpickles what is still queued
        assert dht.is_alive() and not errors, errors
        found = dht.get("key0", latest=True)
        assert found is not None and len(found.value) == 5 and found.value["s0"].value == RECORD
    finally:
        if dht.is_alive():
            dht.shutdown()
        dht.join(timeout=5)
        if dht.is_alive():
            dht.kill()
