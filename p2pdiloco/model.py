"""A small GPT (nanoGPT-style) whose size comes from the config, plus helpers to view its
parameters as one flat vector (what the swarm averages).

    >>> model = GPT.from_config(cfg)
    >>> loss = model(x, y)   # x, y: (batch, block_size) int64 byte ids
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)), drop, self.training)
        return x + F.dropout(self.mlp(self.ln_2(x)), drop, self.training)


class GPT(nn.Module):
    def __init__(self, *, n_layer: int, n_head: int, n_embd: int, block_size: int, vocab_size: int, dropout: float):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    @classmethod
    def from_config(cls, cfg) -> "GPT":
        return cls(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size,
                   vocab_size=cfg.vocab_size, dropout=cfg.dropout)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(idx)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def flat_params(model: nn.Module) -> torch.Tensor:
    """A detached fp32 CPU copy of all parameters as one vector."""
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])


def load_flat_(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat vector into the model's parameters (on their device)."""
    if flat.numel() != num_params(model):
        raise ValueError(f"flat vector has {flat.numel()} values, the model {num_params(model)}")
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p))
            offset += n


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_model(cfg, pretrained: bool = True) -> nn.Module:
    """The model a config describes: the built-in GPT, or a Hugging Face model from `hf_config`
    (holding `init_from`'s weights when the directory has them and pretrained is True). Either way
    `model(idx, targets)` returns the mean next-token cross-entropy."""
    if cfg.init_from and pretrained:
        from p2pdiloco.config import weight_files
        from p2pdiloco.hf import load_pretrained

        if weight_files(cfg.init_from):
            return load_pretrained(cfg)
    if cfg.hf_config:
        from p2pdiloco.hf import build_hf_model  # transformers is an optional extra

        return build_hf_model(cfg)
    return GPT.from_config(cfg)
