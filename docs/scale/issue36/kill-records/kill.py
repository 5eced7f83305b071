# The kill measurement of docs/scale.md ("A dead peer's record"): N tiny peers (names, e.g. abcd), paced 4x,
# H = 30, a SIGKILL of the last after 6 rounds; prints the survivors' rounds for 30 s after it as
# (seconds after the kill, group size, swarm size, round seconds).
#   PYTHONPATH=. .venv/bin/python docs/scale/issue36/kill-records/kill.py OUTDIR CORPUS . abcd
import signal, sys, time, json
from pathlib import Path
root = sys.argv[3]
sys.path.insert(0, root)
from p2pdiloco.localswarm import LocalSwarm
tmp = Path(sys.argv[1]); tmp.mkdir(parents=True, exist_ok=True)
H, names = 30, sys.argv[4]
with LocalSwarm(tmp, config=root + "/peers/tiny-cpu.toml", extra_args=["--data", sys.argv[2], "--inner-steps", str(H),
        "--target-group-size", str(len(names)), "--wait-for-peers", str(len(names)), "--eval-every", "4", "--slowdown", "4"]) as swarm:
    swarm.start_bootstrap("boot")
    for n in names: swarm.start(n, join="boot")
    swarm.wait_for(lambda: all(len(swarm.events(n, "outer")) >= 6 for n in names), timeout=120)
    swarm.signal(names[-1], signal.SIGKILL); t0 = time.time()
    time.sleep(30)
    for n in names[:3]:
        after = [e for e in swarm.events(n, "outer") if e["time"] > t0]
        print(n, [(round(e["time"] - t0, 1), e["group_size"], e["swarm_size"], round(e["round_s"], 1)) for e in after], flush=True)
