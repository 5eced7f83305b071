#!/usr/bin/env python3
"""hivemind baseline: the library a user would pick instead of p2pdiloco. `hivemind.Optimizer` with
use_local_updates=True trains the same model, data, AdamW, lr schedule and eval as a p2pdiloco peer:
each peer steps its own AdamW every step, and once per epoch (when the swarm's samples reach
target_batch_size) the peers average their parameters in a hivemind all-reduce.

    python scripts/hivemind_baseline.py run --peers 2 --steps 60 --inner-steps 20 --config peers/tiny-cpu.toml \\
        --workdir /tmp/x --set threads=1 --set data=corpus.txt
    python scripts/hivemind_baseline.py worker --rank 0 --peers 2 --config peers/tiny-cpu.toml --steps 60 \\
        --inner-steps 20 --log-dir /tmp/x/rank0 --maddrs-file /tmp/x/rank0.maddrs

    from hivemind_baseline import run_hivemind      # scripts/ on sys.path
    result = run_hivemind("runs/hm", peers=4, config="peers/tiny-cpu.toml", steps=200, inner_steps=50)
    result["eval_loss"], [f["epochs"] for f in result["final"]]

target_batch_size = peers x inner_steps x batch_size, so an epoch is about inner_steps local steps of
each peer: DiLoCo's H, with plain parameter averaging for the outer step (what hivemind offers) and
hivemind's defaults otherwise (the AdamW moments are not averaged). The swarm's timeouts are the
preset's: matchmaking_time, allreduce_timeout (hivemind's averaging_timeout), next_chunk_timeout,
request_timeout and state_timeout (hivemind's load_state_timeout).

Every peer writes LOG_DIR/metrics.jsonl (peer "hmR"): "start" once every peer is in the swarm
(setup_s, peers_seen), "inner" every log_interval s (loss, tokens and tokens_per_s of this peer),
"epoch" when hivemind's local_epoch advances (eval_loss every --eval-every epochs, and the averaging
rounds hivemind reported so far), and "final" (this peer's tokens, eval_loss, wall_s from the start
line to the last step, epochs, rounds_averaged and rounds_failed, opt_step_s: the time inside
hivemind.Optimizer.step, and param_sum). Every DHT listens on 127.0.0.1 only.

Tuning note (hivemind 1.1.12): the local step after an epoch's end waits for that epoch's round
(TrainingStateAverager.step waits for delayed updates before any optimizer step), and the round is
never matched ahead of time (the estimate that pre-scheduling needs is only updated by a pre-scheduled
round), so each epoch costs every peer about matchmaking_time plus the all-reduce. An epoch also ends
when the tracker's ETA, from the peers' speeds that never count these waits, has passed: if an epoch's
compute is shorter than a round, epochs shrink to one step each, every step waiting for a round. Keep
inner_steps of compute well above matchmaking_time; `slowdown` (p2pdiloco's pacing: sleep (N-1) times
the forward and backward after each step) stretches tiny steps to that. A peer whose epoch falls
behind the swarm's downloads another's state (load_state_from_peers) and drops that step's update.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOOPBACK_DHT = {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "nat_port_map": False, "auto_nat": False}
START_TIMEOUT = 120.0  # seconds a peer waits at the start line for the others (imports on 2 busy cores)


class RoundCounter(logging.Handler):
    """Counts the averaging rounds that hivemind's TrainingStateAverager reports (verbose=True logs
    "Averaged parameters with N peers" only once the all-reduce returned, "Averaging failed" otherwise)."""

    def __init__(self):
        super().__init__(level=logging.INFO)
        self.group_sizes: list[int] = []
        self.failed = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Averaged parameters with "):
            self.group_sizes.append(int(message.split()[3]))
        elif message.startswith("Averaging failed"):
            self.failed += 1


def quiet_hivemind() -> RoundCounter:
    """hivemind's stderr handler shows warnings only; its INFO status lines still reach the counter."""
    from hivemind.utils.logging import get_logger

    root = get_logger("hivemind")  # installs hivemind's handler on the "hivemind" logger
    root.setLevel(logging.INFO)
    for handler in root.handlers:
        handler.setLevel(logging.WARNING)
    counter = RoundCounter()
    get_logger("hivemind.optim.state_averager").addHandler(counter)
    return counter


def wait_at_start_line(dht, key: str, rank: int, peers: int, timeout: float) -> int:
    """Announce this peer under `key` and wait until `peers` peers did (the DDP rendezvous, p2pdiloco's
    wait_for_peers): a peer that trained alone would pass its first epoch without averaging. Returns
    the peers seen; after `timeout` s training starts anyway."""
    from hivemind.utils.timed_storage import get_dht_time

    dht.store(key, subkey=str(rank), value=True, expiration_time=get_dht_time() + 3600)
    deadline = time.monotonic() + timeout
    while True:
        found = dht.get(key, latest=True)
        seen = len(found.value) if found is not None and isinstance(found.value, dict) else 0
        if seen >= peers or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


def say_goodbye(opt, timeout: float = 10.0) -> None:
    """Stop reporting progress and clear this peer's progress record, waiting (up to `timeout` s) until
    the DHT stored it. hivemind's shutdown sends the same store without waiting, behind the requests
    of the averager process it has just stopped, which the DHT process fails to read at 3 s each; the
    DHT shutdown then drops it. The others would count this peer's samples, extrapolated at its last
    speed, for 60 s: an epoch at each of their steps, each with a round that waits averaging_timeout
    for a partner that is gone. Call it before opt.shutdown()."""
    from hivemind.utils.timed_storage import get_dht_time

    tracker = opt.tracker
    tracker.shutdown(opt.shutdown_timeout)
    future = opt.dht.store(tracker.training_progress_key, subkey=tracker._local_public_key, value=None,
                           expiration_time=get_dht_time() + tracker.metadata_expiration, return_future=True)
    try:
        future.result(timeout)
    except TimeoutError:  # the others see this peer's record expire instead
        print(f"hivemind_baseline: goodbye not stored within {timeout:.0f}s", file=sys.stderr)


def worker(args: argparse.Namespace) -> None:
    import hivemind
    import torch

    from p2pdiloco import diloco, swarm
    from p2pdiloco.config import Config
    from p2pdiloco.data import load_data
    from p2pdiloco.metrics import Metrics
    from p2pdiloco.model import GPT

    cfg = Config.from_sources(args.config, args.set)  # strings: from_sources coerces them
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rank, peers = args.rank, args.peers
    inner_steps = args.inner_steps or cfg.inner_steps
    run_id = args.run_id or cfg.run_id
    rounds = quiet_hivemind()  # before the DHT forks its processes, so that they inherit it
    data = load_data(cfg, progress=lambda line: print(line, file=sys.stderr))
    torch.manual_seed(cfg.seed)  # the same init on every peer
    model = GPT.from_config(cfg)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + rank)
    eval_set = data.eval_batches(cfg.batch_size, cfg.eval_batches)
    metrics = Metrics(args.log_dir, peer=f"hm{rank}", quiet=True)

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        losses = [float(model(x, y)) for x, y in eval_set]
        model.train()
        return sum(losses) / len(losses)

    dht = opt = None
    try:
        t_setup = time.perf_counter()
        dht = hivemind.DHT(start=True, initial_peers=args.initial_peers or None, startup_timeout=cfg.startup_timeout,
                           **LOOPBACK_DHT)
        if args.maddrs_file:
            swarm.write_maddrs(dht, args.maddrs_file)
        opt = hivemind.Optimizer(
            dht=dht, run_id=run_id, params=model.parameters(),
            # lr 0: hivemind initializes the AdamW state with one zero-gradient step, which must not move
            # the weights (weight decay); the schedule sets the real lr before every step
            optimizer=lambda params: torch.optim.AdamW(params, lr=0.0, weight_decay=cfg.weight_decay,
                                                       betas=(0.9, 0.95)),
            target_batch_size=peers * inner_steps * cfg.batch_size, batch_size_per_step=cfg.batch_size,
            use_local_updates=True, matchmaking_time=cfg.matchmaking_time, averaging_timeout=cfg.allreduce_timeout,
            next_chunk_timeout=cfg.next_chunk_timeout, load_state_timeout=cfg.state_timeout,
            averager_opts={"request_timeout": cfg.request_timeout}, verbose=True)
        # opt.param_groups hands out copies: the lr must be set on the AdamW itself. A hivemind scheduler
        # steps once per epoch, too coarse for the per-step warmup and cosine that DDP and p2pdiloco follow.
        inner_opt = opt.state_averager.optimizer
        for state in inner_opt.state.values():
            state["step"].zero_()  # undo the init step's count: bias correction as a fresh AdamW's
        peers_seen = wait_at_start_line(dht, f"{run_id}_started", rank, peers, START_TIMEOUT)
        if peers_seen < peers:
            print(f"hivemind_baseline: {peers_seen} of {peers} peers after {START_TIMEOUT:.0f}s; training anyway",
                  file=sys.stderr)
        t_start = time.perf_counter()
        metrics.log("start", setup_s=t_start - t_setup, peers_seen=peers_seen, epoch=opt.local_epoch)
        tokens_per_step = cfg.batch_size * cfg.block_size
        tokens = 0
        compute_s = step_s = eval_s = opt_step_s = 0.0
        loss_sum, loss_n, tokens_at_log, last_log = 0.0, 0, 0, time.perf_counter()
        epoch = opt.local_epoch
        model.train()
        for step in range(args.steps):
            t0 = time.perf_counter()
            lr = diloco.inner_lr_at(step, inner_lr=cfg.inner_lr, warmup_steps=cfg.warmup_steps,
                                    total_steps=cfg.total_steps, min_lr_ratio=cfg.min_lr_ratio)
            for group in inner_opt.param_groups:
                group["lr"] = lr
            x, y = data.train_batch(cfg.batch_size, gen)
            t1 = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            t_opt = time.perf_counter()
            opt.step()  # the local AdamW step; at an epoch's end it also starts the averaging round
            opt.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            opt_step_s += t2 - t_opt
            compute_s += t2 - t1
            step_s += t2 - t0
            tokens += tokens_per_step
            loss_sum += float(loss.detach())
            loss_n += 1
            if cfg.slowdown > 1:  # p2pdiloco's pacing, on the forward and backward: opt.step may wait for a round
                time.sleep((t_opt - t1) * (cfg.slowdown - 1))
            if t2 - last_log >= cfg.log_interval:
                metrics.log("inner", inner_step=step + 1, loss=loss_sum / loss_n, tokens=tokens,
                            tokens_per_s=(tokens - tokens_at_log) / (t2 - last_log), compute_s=compute_s,
                            step_s=step_s, epoch=opt.local_epoch)
                loss_sum, loss_n, tokens_at_log, last_log = 0.0, 0, tokens, t2
            if opt.local_epoch != epoch:
                epoch = opt.local_epoch
                record = {"epoch": epoch, "inner_step": step + 1, "tokens": tokens,
                          "rounds_averaged": len(rounds.group_sizes), "rounds_failed": rounds.failed}
                if args.eval_every and epoch % args.eval_every == 0 and step + 1 < args.steps:
                    t3 = time.perf_counter()  # the local model: this epoch's round is still in flight
                    record["eval_loss"] = evaluate()
                    eval_s += time.perf_counter() - t3
                metrics.log("epoch", **record)
        wall_s = time.perf_counter() - t_start
        t4 = time.perf_counter()
        opt.state_averager.step(wait_for_delayed_updates=True)  # a round still in flight lands before the eval
        final_wait_s = time.perf_counter() - t4
        param_sum = float(sum(p.detach().double().sum() for p in model.parameters()))
        metrics.log("final", inner_step=args.steps, tokens=tokens, eval_loss=evaluate(), wall_s=wall_s,
                    final_wait_s=final_wait_s, step_s_mean=step_s / max(args.steps, 1), compute_s=compute_s,
                    opt_step_s=opt_step_s, eval_s=eval_s, epochs=opt.local_epoch,
                    rounds_averaged=len(rounds.group_sizes), rounds_failed=rounds.failed,
                    group_sizes=rounds.group_sizes, peers=peers, inner_steps=inner_steps, param_sum=param_sum,
                    param_sum_hex=param_sum.hex())  # Metrics rounds floats to 6 places: keep the exact bits
    finally:
        metrics.close()
        try:
            if opt is not None:
                say_goodbye(opt)
                opt.shutdown()
        finally:
            if dht is not None:
                dht.shutdown()


def _stderr_tail(workdir: Path, rank: int) -> str:
    return (workdir / f"rank{rank}.stderr").read_text(errors="replace")[-3000:]


def run_hivemind(workdir, *, peers: int, config: str, steps: int, inner_steps: int, overrides: dict | None = None,
                 eval_every: int = 1, kill_at: float | None = None, kill_at_step: int | None = None,
                 kill_rank: int | None = None, run_id: str = "", timeout: float = 1800) -> dict:
    """Run `peers` hivemind workers on 127.0.0.1 (rank 0 first: the others join its DHT) and wait for
    all of them. With kill_at, rank kill_rank (default: the last) is SIGKILLed, its whole process
    group (DHT, averager, p2pd) like a crashed machine, kill_at s after its "start" record, or once
    it logged inner step kill_at_step (an "inner" record: every log_interval s).

    Returns {"final": the final records of the ranks that finished, "eval_loss": their mean eval_loss,
    "ranks": [each rank's records], "wall_s": launcher seconds, "pids": worker pids (all reaped),
    "killed": the killed rank or None}. Raises RuntimeError with the failing rank's stderr tail
    (WORKDIR/rankN.stderr) if a rank that was not killed fails, or after `timeout` s; whatever is left
    of every rank's process group is killed in the end."""
    from p2pdiloco.localswarm import kill_group, raise_if_stopping
    from p2pdiloco.metrics import read_metrics

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    kill = kill_at is not None or kill_at_step is not None
    if kill and kill_rank is None:
        kill_rank = peers - 1
    sets = []
    for key, value in (overrides or {}).items():
        value = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        sets += ["--set", f"{key}={value}"]
    maddrs_file = workdir / "rank0.maddrs"
    maddrs_file.unlink(missing_ok=True)
    procs: list[subprocess.Popen] = []
    killed = None
    t0 = time.monotonic()

    def check(rank: int, proc: subprocess.Popen) -> None:
        if proc.returncode not in (None, 0) and rank != killed:
            raise RuntimeError(f"hivemind rank {rank} exited with {proc.returncode}:\n{_stderr_tail(workdir, rank)}")
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"hivemind run exceeded {timeout} s")

    def due(rank: int) -> bool:
        """Is it time to kill rank: kill_at s after its "start" record, or at inner step kill_at_step?"""
        path = workdir / f"rank{rank}" / "metrics.jsonl"
        records = read_metrics(path) if path.exists() else []
        if kill_at_step is not None:
            return max([r["inner_step"] for r in records if r["event"] == "inner"], default=0) >= kill_at_step
        t_start = next((r["time"] for r in records if r["event"] == "start"), None)
        return t_start is not None and time.time() - t_start >= kill_at

    try:
        for rank in range(peers):
            log_dir = workdir / f"rank{rank}"
            (log_dir / "metrics.jsonl").unlink(missing_ok=True)  # Metrics appends; a rerun starts clean
            cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--rank", str(rank), "--peers", str(peers),
                   "--config", str(config), "--steps", str(steps), "--inner-steps", str(inner_steps), "--log-dir",
                   str(log_dir), "--eval-every", str(eval_every), *sets, *(["--run-id", run_id] if run_id else [])]
            if rank == 0:
                cmd += ["--maddrs-file", str(maddrs_file)]
            else:
                cmd += ["--initial-peers", *maddrs_file.read_text().split()]
            with open(workdir / f"rank{rank}.stderr", "w") as err:
                procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                              start_new_session=True))
            while rank == 0 and not maddrs_file.exists():  # the others join through rank 0's DHT
                raise_if_stopping()
                procs[0].poll()
                check(0, procs[0])
                if procs[0].returncode is not None:
                    raise RuntimeError(f"hivemind rank 0 exited before its DHT was up:\n{_stderr_tail(workdir, 0)}")
                time.sleep(0.1)
        while any(p.poll() is None for p in procs):
            raise_if_stopping()  # bench.py's SIGTERM (this loop may run in a worker thread)
            if kill and killed is None and procs[kill_rank].poll() is None:
                if due(kill_rank):
                    try:
                        os.killpg(procs[kill_rank].pid, signal.SIGKILL)
                        killed = kill_rank
                    except ProcessLookupError:  # it finished first: nothing left to kill
                        pass
            for rank, p in enumerate(procs):
                check(rank, p)  # fail fast: the others would wait out their averaging timeouts
            time.sleep(0.2)
        for rank, p in enumerate(procs):
            check(rank, p)
        wall_s = time.monotonic() - t0
    finally:
        for p in procs:
            kill_group(p)  # a clean exit leaves nothing; a killed or failed rank may leave p2pd behind
    ranks = [read_metrics(workdir / f"rank{rank}" / "metrics.jsonl") for rank in range(peers)]
    final = []
    for rank, records in enumerate(ranks):
        mine = [r for r in records if r["event"] == "final"]
        if not mine and rank != killed:
            raise RuntimeError(f"rank {rank} logged no final record in {workdir / f'rank{rank}'}")
        final += mine
    losses = [f["eval_loss"] for f in final if f.get("eval_loss") is not None]
    return {"final": final, "eval_loss": sum(losses) / len(losses) if losses else None, "ranks": ranks,
            "wall_s": wall_s, "pids": [p.pid for p in procs], "killed": killed}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="one hivemind peer")
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--log-dir", required=True)
    w.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of a running peer (rank 0)")
    w.add_argument("--maddrs-file", help="write this peer's multiaddrs here once its DHT is up")
    r = sub.add_parser("run", help="launch the local peers and print the mean final eval loss and their records")
    r.add_argument("--workdir", required=True)
    r.add_argument("--timeout", type=float, default=1800)
    r.add_argument("--kill-at", type=float, help="SIGKILL --kill-rank this many seconds after its start")
    r.add_argument("--kill-at-step", type=int, help="SIGKILL --kill-rank once it logged this inner step")
    r.add_argument("--kill-rank", type=int)
    for p in (w, r):
        p.add_argument("--peers", type=int, required=True)
        p.add_argument("--config", required=True)
        p.add_argument("--steps", type=int, required=True, help="local inner steps of every peer")
        p.add_argument("--inner-steps", type=int, default=0, help="H: one epoch is about this many steps per peer "
                       "(0 = the config's inner_steps)")
        p.add_argument("--eval-every", type=int, default=1, help="eval every N epochs (0 = at the end only)")
        p.add_argument("--run-id", default="", help="hivemind run_id (default: the config's run_id)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = ap.parse_args(argv)
    if any("=" not in pair for pair in args.set):
        ap.error("--set expects KEY=VALUE")
    args.set = dict(pair.split("=", 1) for pair in args.set)
    if args.cmd == "worker":
        worker(args)
        return
    if args.inner_steps <= 0:
        from p2pdiloco.config import Config

        args.inner_steps = Config.from_sources(args.config, args.set).inner_steps
    result = run_hivemind(args.workdir, peers=args.peers, config=args.config, steps=args.steps,
                          inner_steps=args.inner_steps, overrides=args.set, eval_every=args.eval_every,
                          kill_at=args.kill_at, kill_at_step=args.kill_at_step, kill_rank=args.kill_rank,
                          run_id=args.run_id, timeout=args.timeout)
    print(json.dumps({"eval_loss": result["eval_loss"], "wall_s": result["wall_s"], "killed": result["killed"],
                      "final": result["final"]}))


if __name__ == "__main__":
    main()
