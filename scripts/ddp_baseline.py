#!/usr/bin/env python3
"""Data-parallel baseline: the same model, data, AdamW, lr schedule and eval as a p2pdiloco peer, but
trained with torch.distributed (gloo) + DistributedDataParallel, all-reducing gradients every step.

    python scripts/ddp_baseline.py run --world-size 2 --steps 50 --config peers/tiny-cpu.toml --workdir /tmp/x
    python scripts/ddp_baseline.py worker --rank 0 --world-size 2 --master-addr 127.0.0.1 --master-port 29500 \\
        --config peers/tiny-cpu.toml --steps 50 --log-dir /tmp/x/rank0 --set threads=1 --set data=corpus.txt

    from ddp_baseline import run_ddp      # scripts/ on sys.path
    result = run_ddp("runs/ddp", world_size=4, config="peers/tiny-cpu.toml", steps=200)
    result["final"]["eval_loss"], result["final"]["wall_s"]

Each rank draws `batch_size` sequences per step from its own generator, so the global batch is
world_size x batch_size. Every rank writes LOG_DIR/metrics.jsonl (peer "ddpR"): "inner" every
log_interval s (loss, tokens and tokens_per_s of this rank, cumulative compute_s and step_s), "eval"
every --eval-every steps (rank 0), and "final" (global tokens, eval_loss, wall_s from the rendezvous
to the last step, of which setup_s builds DDP and eval_s is rank 0's periodic evals, step_s_mean, and
param_sum, a checksum that is equal on all ranks only if the gradients really were all-reduced).
CPU only: gloo is the backend that needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from p2pdiloco import diloco
    from p2pdiloco.config import Config
    from p2pdiloco.data import load_data
    from p2pdiloco.metrics import Metrics
    from p2pdiloco.model import GPT

    cfg = Config.from_sources(args.config, args.set)  # strings: from_sources coerces them
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname  # inside a netns the default interface guess is wrong
    rank, world = args.rank, args.world_size
    # everything slow happens before the rendezvous, so wall_s measures training only
    data = load_data(cfg, progress=lambda line: print(line, file=sys.stderr))
    torch.manual_seed(cfg.seed)  # the same init as every peer (DDP would broadcast rank 0's anyway)
    model = GPT.from_config(cfg)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + rank)
    eval_set = data.eval_batches(cfg.batch_size, cfg.eval_batches)
    metrics = Metrics(args.log_dir, peer=f"ddp{rank}", quiet=True)

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        losses = [float(model(x, y)) for x, y in eval_set]  # the plain module: no DDP hooks, no comm
        model.train()
        return sum(losses) / len(losses)

    dist.init_process_group("gloo", init_method=f"tcp://{args.master_addr}:{args.master_port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        t_start = time.perf_counter()
        ddp = DistributedDataParallel(model)  # 0.7-2 s on 2 cores (rank 0 broadcasts its weights): setup_s
        setup_s = time.perf_counter() - t_start
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner_lr, weight_decay=cfg.weight_decay,
                                betas=(0.9, 0.95))
        tokens_per_step = cfg.batch_size * cfg.block_size
        tokens = 0
        compute_s = step_s = eval_s = 0.0
        loss_sum, loss_n, tokens_at_log, last_log = 0.0, 0, 0, time.perf_counter()
        model.train()
        for step in range(args.steps):
            t0 = time.perf_counter()
            lr = diloco.inner_lr_at(step, inner_lr=cfg.inner_lr, warmup_steps=cfg.warmup_steps,
                                    total_steps=cfg.total_steps, min_lr_ratio=cfg.min_lr_ratio)
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = data.train_batch(cfg.batch_size, gen)
            t1 = time.perf_counter()
            loss = ddp(x, y)
            loss.backward()  # DDP all-reduces (averages) the gradients inside backward
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            compute_s += t2 - t1
            step_s += t2 - t0
            tokens += tokens_per_step
            loss_sum += float(loss.detach())
            loss_n += 1
            if t2 - last_log >= cfg.log_interval:
                metrics.log("inner", inner_step=step + 1, loss=loss_sum / loss_n, tokens=tokens,
                            tokens_per_s=(tokens - tokens_at_log) / (t2 - last_log), compute_s=compute_s,
                            step_s=step_s)
                loss_sum, loss_n, tokens_at_log, last_log = 0.0, 0, tokens, t2
            if rank == 0 and args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
                t3 = time.perf_counter()  # the other ranks wait for this at the next all-reduce
                metrics.log("eval", inner_step=step + 1, tokens=world * tokens, eval_loss=evaluate())
                eval_s += time.perf_counter() - t3
        wall_s = time.perf_counter() - t_start
        param_sum = float(sum(p.detach().double().sum() for p in model.parameters()))
        metrics.log("final", inner_step=args.steps, tokens=world * tokens, eval_loss=evaluate(), wall_s=wall_s,
                    step_s_mean=step_s / max(args.steps, 1), setup_s=setup_s, compute_s=compute_s, eval_s=eval_s,
                    world_size=world, param_sum=param_sum,
                    param_sum_hex=param_sum.hex())  # Metrics rounds floats to 6 places: keep the exact bits
    finally:
        metrics.close()
        dist.destroy_process_group()


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole session: a prefix like `ip netns exec` puts the worker one level down."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    proc.wait()


def run_ddp(workdir, *, world_size: int, config: str, steps: int, overrides: dict | None = None,
            prefixes: list[list[str]] | None = None, master_addr: str = "127.0.0.1",
            master_port: int | None = None, ifname: str | None = None, eval_every: int = 0,
            timeout: float = 1800) -> dict:
    """Run world_size DDP workers (rank i as `prefixes[i] + [python, this file, "worker", ...]`) and wait
    for all of them. Returns {"final": rank 0's final record, "ranks": [each rank's records],
    "wall_s": launcher seconds, "pids": worker pids (all reaped)}. Raises RuntimeError with the failing
    rank's stderr tail (WORKDIR/rankN.stderr) if one fails, or after `timeout` s; all workers are killed."""
    from p2pdiloco.localswarm import raise_if_stopping
    from p2pdiloco.metrics import read_metrics

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if master_port is None:
        # from here we can only probe our own namespace; elsewhere take a port unlikely to be in use
        local = master_addr in ("127.0.0.1", "localhost")
        master_port = _free_port(master_addr) if local else 29500 + os.getpid() % 1000
    sets = []
    for key, value in (overrides or {}).items():
        value = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        sets += ["--set", f"{key}={value}"]
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    try:
        for rank in range(world_size):
            log_dir = workdir / f"rank{rank}"
            (log_dir / "metrics.jsonl").unlink(missing_ok=True)  # Metrics appends; a rerun starts clean
            cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--rank", str(rank),
                   "--world-size", str(world_size), "--master-addr", master_addr, "--master-port",
                   str(master_port), "--config", str(config), "--steps", str(steps), "--log-dir", str(log_dir),
                   "--eval-every", str(eval_every), *sets, *(["--ifname", ifname] if ifname else [])]
            prefix = prefixes[rank] if prefixes else []
            with open(workdir / f"rank{rank}.stderr", "w") as err:
                procs.append(subprocess.Popen(prefix + cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                              start_new_session=True))
        while any(p.poll() is None for p in procs):
            raise_if_stopping()  # bench.py's SIGTERM (this loop may run in a worker thread)
            # one failed rank leaves the others blocked in gloo until its timeout: fail fast instead
            for rank, p in enumerate(procs):
                if p.returncode not in (None, 0):
                    tail = (workdir / f"rank{rank}.stderr").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"ddp rank {rank} exited with {p.returncode}:\n{tail}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"ddp run exceeded {timeout} s")
            time.sleep(0.2)
        for rank, p in enumerate(procs):
            if p.returncode != 0:
                tail = (workdir / f"rank{rank}.stderr").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"ddp rank {rank} exited with {p.returncode}:\n{tail}")
        wall_s = time.monotonic() - t0
    finally:
        for p in procs:
            _kill(p)
    ranks = [read_metrics(workdir / f"rank{rank}" / "metrics.jsonl") for rank in range(world_size)]
    final = next((r for r in ranks[0] if r["event"] == "final"), None)
    if final is None:
        raise RuntimeError(f"rank 0 logged no final record in {workdir / 'rank0'}")
    return {"final": final, "ranks": ranks, "wall_s": wall_s, "pids": [p.pid for p in procs]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="one DDP rank")
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--master-addr", required=True)
    w.add_argument("--master-port", type=int, required=True)
    w.add_argument("--log-dir", required=True)
    w.add_argument("--ifname", help="GLOO_SOCKET_IFNAME, e.g. the veth inside a network namespace")
    r = sub.add_parser("run", help="launch world_size local workers and print rank 0's final record")
    r.add_argument("--workdir", required=True)
    r.add_argument("--master-addr", default="127.0.0.1")
    r.add_argument("--timeout", type=float, default=1800)
    for p in (w, r):
        p.add_argument("--world-size", type=int, required=True)
        p.add_argument("--config", required=True)
        p.add_argument("--steps", type=int, required=True)
        p.add_argument("--eval-every", type=int, default=0, help="eval on rank 0 every N steps (0 = at the end)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = ap.parse_args(argv)
    if any("=" not in pair for pair in args.set):
        ap.error("--set expects KEY=VALUE")
    args.set = dict(pair.split("=", 1) for pair in args.set)
    if args.cmd == "worker":
        worker(args)
        return
    result = run_ddp(args.workdir, world_size=args.world_size, config=args.config, steps=args.steps,
                     overrides=args.set, master_addr=args.master_addr, eval_every=args.eval_every,
                     timeout=args.timeout)
    print(json.dumps(result["final"]))


if __name__ == "__main__":
    main()
