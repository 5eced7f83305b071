"""Tests only (tests/test_training_thread.py): with this directory on PYTHONPATH and DHT_GUARD_FILE
set, every call of a hivemind DHT method in this process appends a line to that file: the calling
thread's name, the method, and whether the call came from the training loop (Peer._train, outside
its begin_training and finish_training) with the p2pdiloco frames that made it. Nothing happens
without DHT_GUARD_FILE."""

import os

if os.environ.get("DHT_GUARD_FILE"):
    import functools
    import sys
    import threading

    import hivemind

    _PATH = os.environ["DHT_GUARD_FILE"]
    _lock = threading.Lock()

    def _in_training_loop() -> tuple[bool, str]:
        frames, names = sys._getframe(2), []
        while frames is not None:
            code = frames.f_code
            if "p2pdiloco" in code.co_filename:
                names.append(code.co_name)
            frames = frames.f_back
        inside = "_train" in names and not {"begin_training", "finish_training"} & set(names)
        return inside, ">".join(reversed(names))

    def _guard(method, name):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            inside, where = _in_training_loop()
            with _lock, open(_PATH, "a") as f:
                f.write(f"{threading.current_thread().name}\t{name}\t{int(inside)}\t{where}\n")
            return method(self, *args, **kwargs)
        return guarded

    for _name in ("get", "store", "run_coroutine", "get_visible_maddrs"):
        setattr(hivemind.DHT, _name, _guard(getattr(hivemind.DHT, _name), _name))
