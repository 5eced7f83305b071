"""`p2pdiloco sample`: continuations of a prompt from the anchor of a checkpoint or of a live
swarm (nanoGPT's `sample.py`: temperature and top-k, each sample cut at the end-of-text token), so
that a user sees what the swarm has learned.

    p2pdiloco sample --config peers/tiny-cpu.toml --data data/mine --checkpoint-dir ckpt --prompt "The king"
    p2pdiloco sample --config peers/tiny-cpu.toml --data data/mine --initial-peers ADDR --prompt "The king"

The preset and flags are the ones the peers train with (the checkpoint or the run must match
them); the tokenizer is the prepared data's, or bytes for text data. From a live swarm, the
sampler downloads the newest state as a joiner does (state.py, from several peers), as a client:
it serves nothing, joins no round, and leaves when it has printed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from p2pdiloco.export import EXIT_USAGE, add_config_flags, load_kept_model, run_with_config, tokenizer_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser)
    parser.add_argument("--prompt", default="\n", help="Text to continue (default: a newline).")
    parser.add_argument("--num-samples", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50, help="Sample among the k likeliest tokens (0 = all).")
    parser.add_argument("--sample-seed", type=int, default=1337)


def generate(model, idx, *, max_new_tokens: int, block_size: int, temperature: float, top_k: int,
             eot_id: Optional[int], generator):
    """Continue each row of idx (a LongTensor [n, t]) token by token, until every row has hit the
    EOT token or max_new_tokens."""
    import torch

    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model.logits(idx[:, -block_size:])[:, -1, :].float() / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
            if eot_id is not None and bool((idx == eot_id)[:, -max_new_tokens:].any(dim=1).all()):
                break
    return idx


def load_live_model(cfg):
    """The config's model holding the anchor of the live swarm's newest state (from initial_peers)."""
    import torch

    from p2pdiloco import bootstrap, state, swarm
    from p2pdiloco.averaging import DilocoAverager
    from p2pdiloco.export import ExportError
    from p2pdiloco.model import build_model, load_flat_, num_params

    cfg.client_mode = True  # not a DHT server, not a state source: a reader
    dht = averager = None
    try:
        dht = bootstrap.start_dht(cfg)
        swarm.check_run_config(dht, cfg)
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, pretrained=False)  # the anchor replaces every weight
        numel = num_params(model)
        averager = DilocoAverager([torch.empty(numel)], dht, cfg=cfg, shared=state.SharedState(numel),
                                  client_mode=True)
        loaded = state.download_state(averager, cfg, numel, timeout=cfg.state_timeout)
        if loaded is None:
            raise ExportError(f"no live peer of run {cfg.run_id!r} shared its state within {cfg.state_timeout:.0f}s "
                              f"(--state-timeout)")
        load_flat_(model, loaded.anchor.float())
        return model.eval(), f"the live swarm ({len(loaded.sources)} source(s))", loaded.outer_step
    finally:
        if averager is not None:
            averager.shutdown()
        if dht is not None:
            dht.shutdown()


def sample(cfg, args, out=sys.stdout) -> None:
    import torch

    from p2pdiloco.export import ExportError

    if cfg.checkpoint_dir:
        model, path, outer_step = load_kept_model(cfg)
        where = path.name
    elif cfg.initial_peers:
        model, where, outer_step = load_live_model(cfg)
    else:
        raise ExportError("pass --checkpoint-dir (a peer's checkpoints) or --initial-peers (a live swarm)")
    tok, manifest = tokenizer_of(cfg)
    eot = tok.eot_id if manifest is not None else None
    prompt = [int(i) for i in tok.encode_batch([args.prompt])[0]] or [eot if eot is not None else 10]
    idx = torch.tensor([prompt] * args.num_samples, dtype=torch.long)
    g = torch.Generator().manual_seed(args.sample_seed)
    idx = generate(model, idx, max_new_tokens=args.max_new_tokens, block_size=cfg.block_size,
                   temperature=args.temperature, top_k=args.top_k, eot_id=eot, generator=g)
    print(f"# {where}, outer step {outer_step}", file=out)
    for row in idx.tolist():
        new = row[len(prompt):]
        if eot is not None and eot in new:
            new = new[:new.index(eot)]
        print(tok.decode(prompt + new), file=out)
        print("-" * 40, file=out)


def run(args: argparse.Namespace) -> int:
    if args.num_samples < 1 or args.max_new_tokens < 1 or not args.temperature > 0 or args.top_k < 0:
        print("p2pdiloco: error: --num-samples and --max-new-tokens must be >= 1, --temperature > 0, --top-k >= 0",
              file=sys.stderr)
        return EXIT_USAGE
    return run_with_config(args, lambda cfg: sample(cfg, args))
