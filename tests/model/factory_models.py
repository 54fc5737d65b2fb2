"""A user's own model, unknown to plait, built by a factory (``model.factory =
"tests.model.factory_models:build"``) and carrying its own tensor-parallel plan.

A GPT-2-style causal LM: learned positions, LayerNorm with biases, attention whose Q,
K, V and output projections have biases, a GELU MLP, an untied head. Its attention
reads the head count from the projection's shape (``view(b, s, -1, head_dim)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig

TP_PLAN = (
    ("wte", "vocab_embedding"),
    ("wpe", "replicate"),
    ("blocks.*.ln1", "replicate"),
    ("blocks.*.attn", "region"),
    ("blocks.*.attn.q", "colwise_heads"),
    ("blocks.*.attn.k", "colwise_heads"),
    ("blocks.*.attn.v", "colwise_heads"),
    ("blocks.*.attn.proj", "rowwise_heads"),
    ("blocks.*.ln2", "replicate"),
    ("blocks.*.mlp", "region"),
    ("blocks.*.mlp.fc", "colwise"),
    ("blocks.*.mlp.proj", "rowwise"),
    ("ln_f", "replicate"),
    ("head", "vocab_head"),
)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            f(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, heads, s, head_dim)
            for f in (self.q, self.k, self.v)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, s, hd)
        return self.proj(o.transpose(1, 2).reshape(b, s, -1))  # (b, s, dim)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # (b, s, dim)


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(
            GPTBlock(cfg.dim, cfg.n_heads, 4 * cfg.dim) for _ in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.plait_tp_plan = TP_PLAN  # parallelize uses it when no plan is passed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.wte(tokens) + self.wpe(pos)  # (batch, seq, dim)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))  # (batch, seq, vocab)


def build(cfg: ModelConfig) -> nn.Module:
    """The factory ``model.factory`` names: called with the run's model config."""
    return TinyGPT(cfg)
