"""Hugging Face transformers models built from a config file, trained like the built-in GPT.

`hf_config` names a JSON file in the format of a hub `config.json` (at least `model_type`, plus
the keys of that model's config class). The model is built with
`AutoModelForCausalLM.from_config`: random init from the run's seed, no weights and nothing
fetched from the hub. Its `vocab_size` must be the data's (256 for bytes, the manifest's for
prepared tokens) and `max_position_embeddings` at least `block_size`.

    >>> cfg = Config.from_sources("peers/tiny-llama.toml")   # hf_config = "hf/tiny-llama.json"
    >>> model = build_hf_model(cfg)
    >>> loss = model(x, y)   # x, y: (batch, block_size) int64 byte ids, y = x shifted by one

The GPT keys (`n_layer`, `n_head`, `n_embd`, `dropout`) do not apply: the JSON holds the shape
and the dropout of the model. Parameters are fp32 and the JSON's `dtype`/`torch_dtype` is
ignored: the swarm averages fp32 anchors, and CUDA peers train under bf16 autocast. Attention is
PyTorch's `sdpa`, which runs on CPU and GPU alike (`eager` for architectures without it).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from p2pdiloco.config import ConfigError

ATTENTION = "sdpa"  # torch's fused attention: CPU and CUDA, fp32 and bf16 autocast; no extra package


class HFCausalLM(nn.Module):
    """A transformers causal LM behind our model contract: `model(idx, targets)` is the mean
    cross-entropy of the logits against targets that are already shifted (no label shifting here)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx, use_cache=False).logits

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(idx)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def load_pretrained(cfg) -> nn.Module:
    """`init_from`'s model with its weights (fp32, from local files only)."""
    import transformers

    model = build_hf_model(cfg)  # checks the config as for hf_config; its random weights are replaced
    try:
        lm = transformers.AutoModelForCausalLM.from_pretrained(cfg.init_from, local_files_only=True,
                                                               dtype=torch.float32, attn_implementation=ATTENTION)
    except Exception as e:  # transformers raises many types for a bad directory
        raise ConfigError(f"init_from {cfg.init_from}: {_one_line(e)}") from None
    model.lm.load_state_dict(lm.state_dict())
    return model


def build_hf_model(cfg) -> nn.Module:
    """Build the model that `cfg.hf_config` describes. The caller seeds torch first (peer.py does):
    transformers initialises the weights from torch's global generator, so every peer gets the same init."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("hf_config needs the hf extra: pip install 'p2pdiloco[hf]'") from None

    where = f"hf_config {cfg.hf_config}"
    raw = cfg.hf_json
    model_type = raw.pop("model_type")
    for key in ("dtype", "torch_dtype"):  # a hub config.json's bf16 would build bf16 parameters; ours are fp32
        raw.pop(key, None)
    if model_type not in transformers.CONFIG_MAPPING:
        raise ConfigError(f"{where}: unknown model_type {model_type!r} for transformers {transformers.__version__}")
    try:
        hf_cfg = transformers.AutoConfig.for_model(model_type, **raw)
    except Exception as e:  # transformers raises many unrelated types for bad values
        raise ConfigError(f"{where}: {_one_line(e)}") from None
    unknown = sorted(k for k in raw if k in vars(hf_cfg) and k not in _known_keys(type(hf_cfg)))
    if unknown:  # a config class keeps any keyword as an attribute; legacy keys it converts are gone by now
        raise ConfigError(f"{where}: unknown key(s) for model_type {model_type!r}: {', '.join(unknown)}")
    vocab = getattr(hf_cfg, "vocab_size", None)
    if vocab != cfg.vocab_size:
        raise ConfigError(f"{where}: vocab_size is {vocab!r}, the data needs vocab_size = {cfg.vocab_size}")
    max_pos = getattr(hf_cfg, "max_position_embeddings", None)
    if max_pos is not None and max_pos < cfg.block_size:
        raise ConfigError(f"{where}: max_position_embeddings ({max_pos}) must be >= block_size ({cfg.block_size})")
    try:
        lm = _from_config(transformers, hf_cfg)
        _smoke_test(lm)  # shapes that do not fit fail here, in one line, not at the first step
    except Exception as e:  # e.g. a model type without a causal LM head, or heads that do not divide
        raise ConfigError(f"{where}: cannot build a causal LM: {_one_line(e)}") from None
    return HFCausalLM(lm)


def _from_config(transformers, hf_cfg) -> nn.Module:
    try:
        return transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=ATTENTION)
    except ValueError:  # an architecture without sdpa support (bloom, mpt, ...): the plain implementation
        return transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")


def _smoke_test(lm: nn.Module) -> None:
    """One forward pass over 8 tokens in eval mode: no dropout, so torch's generator is untouched."""
    lm.eval()
    try:
        with torch.no_grad():
            lm(input_ids=torch.zeros(1, 8, dtype=torch.long), use_cache=False)
    finally:
        lm.train()


def _known_keys(config_class) -> set[str]:
    known = set(config_class.attribute_map)
    try:
        known |= set(config_class().to_dict())
    except Exception:  # a composite config without defaults: its dataclass fields below still count
        pass
    if dataclasses.is_dataclass(config_class):
        known |= {f.name for f in dataclasses.fields(config_class)}
    return known


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."
