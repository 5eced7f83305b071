"""The swarm's model out again: `p2pdiloco export`, from a checkpoint.

    p2pdiloco export --config peers/tiny-cpu.toml --data data/mine --checkpoint-dir ckpt --out model/

It takes the preset and flags the peer trained with (the checkpoint must match their fingerprint)
and read the model the peer keeps from the newest good checkpoint: the average of its last anchors (the
swarm's model after each outer step, `anchor_average`), or the anchor itself in a checkpoint without one;
never the peer's local weights.

`export` writes a model directory that transformers loads with `from_pretrained` (safetensors and
config.json): the built-in GPT is GPT-2's architecture with exact GELU, so it maps one to one onto
`GPT2LMHeadModel` (`activation_function = "gelu"`; nn.Linear weights transposed into GPT-2's
Conv1D); an `hf_config` model is saved as the transformers model it already is. With prepared
data the tokenizer goes along (a `PreTrainedTokenizerFast` from the shards' tokenizer.json, its
end-of-text token as eos); byte data has no transformers tokenizer (ids are UTF-8 bytes), which a
README.txt in the directory says. `sample` is in sample.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

EXIT_USAGE = 2


class ExportError(ValueError):
    """A checkpoint or output that cannot be used; reported on one line (exit 2)."""


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `join` (preset and every config key): export and sample read a peer's checkpoint."""
    from p2pdiloco.cli import _add_config_flags

    _add_config_flags(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser)
    parser.add_argument("--out", required=True, help="Directory to write the transformers model into.")


def load_kept_model(cfg):
    """The config's model holding the kept model (the anchors' average, else the anchor) of the newest usable
    checkpoint in cfg.checkpoint_dir."""
    import torch

    from p2pdiloco import checkpoint
    from p2pdiloco.model import build_model, load_flat_

    if not cfg.checkpoint_dir:
        raise ExportError("pass --checkpoint-dir: the directory of the peer's checkpoints")
    if not Path(cfg.checkpoint_dir).is_dir():
        raise ExportError(f"checkpoint dir {cfg.checkpoint_dir} does not exist")
    payload, path, _ = checkpoint.load_latest(cfg.checkpoint_dir, cfg)
    if payload is None:
        raise ExportError(f"no checkpoint in {cfg.checkpoint_dir}")
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, pretrained=False)  # the checkpoint's weights replace every one
    average, anchor = payload.get("average"), payload["anchor"]
    usable = isinstance(average, torch.Tensor) and average.numel() == anchor.numel() and bool(average.isfinite().all())
    load_flat_(model, (average if usable else anchor).float())
    return model.eval(), path, int(payload["outer_step"])


def tokenizer_of(cfg):
    """(our Tokenizer, the manifest or None) of the config's data: bytes for text data."""
    from p2pdiloco.data import data_path
    from p2pdiloco.data.manifest import is_prepared, read_manifest
    from p2pdiloco.data.tokenizer import Tokenizer, tokenizer_from_json

    data = data_path(cfg.data)
    if data and is_prepared(data):
        manifest = read_manifest(data)
        return tokenizer_from_json(manifest.tokenizer_text(), manifest.eot_id), manifest
    return Tokenizer(), None


def to_gpt2(model, cfg, eot_id: Optional[int]):
    """A transformers GPT2LMHeadModel holding the built-in GPT's weights (the same function)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    conf = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                      n_layer=cfg.n_layer, n_head=cfg.n_head, activation_function="gelu", resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                      bos_token_id=eot_id, eos_token_id=eot_id)
    sd = {"transformer.wte.weight": model.wte.weight, "transformer.wpe.weight": model.wpe.weight,
          "transformer.ln_f.weight": model.ln_f.weight, "transformer.ln_f.bias": model.ln_f.bias,
          "lm_head.weight": model.head.weight}
    for i, b in enumerate(model.blocks):
        h = f"transformer.h.{i}."
        sd.update({h + "ln_1.weight": b.ln_1.weight, h + "ln_1.bias": b.ln_1.bias,
                   h + "ln_2.weight": b.ln_2.weight, h + "ln_2.bias": b.ln_2.bias,
                   h + "attn.c_attn.weight": b.qkv.weight.t(), h + "attn.c_attn.bias": b.qkv.bias,
                   h + "attn.c_proj.weight": b.proj.weight.t(), h + "attn.c_proj.bias": b.proj.bias,
                   h + "mlp.c_fc.weight": b.mlp[0].weight.t(), h + "mlp.c_fc.bias": b.mlp[0].bias,
                   h + "mlp.c_proj.weight": b.mlp[2].weight.t(), h + "mlp.c_proj.bias": b.mlp[2].bias})
    hf = GPT2LMHeadModel(conf)
    missing, unexpected = hf.load_state_dict({k: v.detach().contiguous().clone() for k, v in sd.items()}, strict=False)
    missing = [k for k in missing if not k.endswith(("attn.bias", "attn.masked_bias"))]  # causal-mask buffers
    if missing or unexpected:
        raise ExportError(f"GPT-2 mapping incomplete: missing {missing}, unexpected {unexpected}")
    return hf.eval()


def export(cfg, out: str | Path, progress=print) -> Path:
    """Write the newest checkpoint's kept model as a transformers model directory."""
    try:
        import transformers
    except ImportError:
        raise ExportError("export needs transformers: pip install 'p2pdiloco[hf]'") from None
    transformers.utils.logging.disable_progress_bar()  # its shard-writing bar; our status line is the record
    model, path, outer_step = load_kept_model(cfg)
    tok, manifest = tokenizer_of(cfg)
    eot = tok.eot_id if manifest is not None else None
    hf = model.lm if cfg.hf_config else to_gpt2(model, cfg, eot)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out, safe_serialization=True)
    if manifest is not None and manifest.tokenizer_text() is not None:
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tok, eos_token=tok.tok.id_to_token(eot),
                                                    bos_token=tok.tok.id_to_token(eot))
        fast.model_max_length = cfg.block_size
        fast.save_pretrained(out)
        what = "tokenizer included"
    else:
        (out / "README.txt").write_text("Trained by p2pdiloco on bytes: token ids are the UTF-8 bytes of the text "
                                        f"(vocab {cfg.vocab_size}); transformers has no tokenizer for that.\n")
        what = "byte-level ids: no tokenizer (see README.txt)"
    progress(f"p2pdiloco: exported {path.name} (outer step {outer_step}) to {out} "
             f"({'hf_config model' if cfg.hf_config else 'GPT2LMHeadModel'}; {what})")
    return out


def run_with_config(args, body) -> int:
    """Resolve the config from the flags and run body(cfg); expected failures are one line, exit 2."""
    from p2pdiloco.checkpoint import CheckpointError
    from p2pdiloco.cli import resolve_config
    from p2pdiloco.data import DataError
    from p2pdiloco.swarm import SwarmError

    cfg = resolve_config(args)
    try:
        body(cfg)
    except (ExportError, CheckpointError, DataError, SwarmError) as e:
        print(f"p2pdiloco: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"p2pdiloco: error: cannot write {getattr(args, 'out', '')}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def run(args: argparse.Namespace) -> int:
    return run_with_config(args, lambda cfg: export(cfg, args.out))
