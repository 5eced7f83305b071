"""Your own model in a p2pdiloco swarm: an MLP, its own optimizer, data and loss, and one extra
call per step. Run one process per peer (each on its own GPU or CPU cores):

    python examples/custom_model.py --maddrs-file a.txt                       # the first peer
    python examples/custom_model.py --initial-peers $(head -1 a.txt)          # any number more

Each peer fits y = sin(4 x0) cos(3 x1) + sin(5 x0 x2) / 2 from its own random samples; every
`--inner-steps` steps the peers average their pseudo-gradients in the background and the eval
loss (on the anchor, the swarm's model) falls faster than one peer alone would manage.
"""

import argparse
import copy
import math
import sys
import time

import torch
import torch.nn.functional as F

import p2pdiloco


def batches(seed: int, batch_size: int = 64):
    """Your data iterator: here, endless random samples of the target function."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        x = torch.rand(batch_size, 3, generator=gen) * 2 - 1
        yield x, target(x)


def target(x: torch.Tensor) -> torch.Tensor:
    return (torch.sin(4 * x[:, 0]) * torch.cos(3 * x[:, 1]) + torch.sin(5 * x[:, 0] * x[:, 2]) / 2).unsqueeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--maddrs-file", default="")
    parser.add_argument("--host", default="127.0.0.1", help="Listen address (0.0.0.0 for other machines).")
    parser.add_argument("--max-steps", type=int, default=2000)
    parser.add_argument("--max-time", type=float, default=0.0, help="Also stop after this many seconds (0 = no limit).")
    parser.add_argument("--max-outer-steps", type=int, default=0, help="Also stop at this outer step (0 = no limit).")
    parser.add_argument("--hidden", type=int, default=64, help="Width of the MLP (every peer of a run must agree).")
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1, help="This peer's data order.")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.5, help="Lower than the LM default (0.9): on this "
                        "small regression, 0.9 overshoots.")
    parser.add_argument("--log-dir", default="")
    args = parser.parse_args()

    torch.manual_seed(0)  # the same init on every peer of the run
    width = args.hidden
    model = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                torch.nn.GELU(), torch.nn.Linear(width, 1))
    inner_opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x_eval = torch.rand(512, 3, generator=torch.Generator().manual_seed(12345)) * 2 - 1

    @torch.no_grad()
    def eval_fn(anchor_model: torch.nn.Module) -> float:  # called on a copy holding the anchor
        return float(F.mse_loss(anchor_model(x_eval), target(x_eval)))

    with p2pdiloco.DiLoCo(model, inner_opt, run_id="custom-mlp", initial_peers=args.initial_peers,
                          inner_steps=args.inner_steps, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                          eval_fn=eval_fn,
                          host_maddrs=[f"/ip4/{args.host}/tcp/0"], maddrs_file=args.maddrs_file,
                          log_dir=args.log_dir, log_interval=1.0, quiet=False) as diloco:
        print(f"peer {diloco.peer_id} at {diloco.maddrs[0]}", flush=True)
        t_end = time.monotonic() + args.max_time if args.max_time else math.inf
        for step, (x, y) in enumerate(batches(args.seed)):
            if step >= args.max_steps or time.monotonic() >= t_end or (
                    args.max_outer_steps and diloco.outer_step >= args.max_outer_steps):
                break
            loss = F.mse_loss(model(x), y)
            loss.backward()
            inner_opt.step()
            inner_opt.zero_grad()
            if diloco.step(loss, tokens=len(x)):
                print(f"outer step {diloco.outer_step}: eval loss of the local model {eval_fn(model):.4f}", flush=True)
        kept = copy.deepcopy(model)
        diloco.load_kept_(kept)  # the model to keep: the moving average of the swarm's anchors (anchor_average)
    print(f"done: outer step {diloco.outer_step}, eval loss of the local model {eval_fn(model):.4f}, "
          f"of the kept model {eval_fn(kept):.4f}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except (p2pdiloco.SwarmError, p2pdiloco.ConfigError) as e:  # e.g. another model in this run: one line
        print(f"custom_model: error: {e}", file=sys.stderr)
        sys.exit(2)
