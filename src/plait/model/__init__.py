"""The built-in decoder-only transformer and its size/FLOP accounting."""

from __future__ import annotations

from plait.config.presets import MODEL_PRESETS, model_preset
from plait.model.transformer import (
    IGNORE_INDEX,
    Attention,
    Block,
    BlockwiseAttention,
    FeedForward,
    RMSNorm,
    SDPAttention,
    TokenPositions,
    Transformer,
    apply_rotary,
    flops_per_token,
    lm_loss,
    materialize,
    param_count,
    rope_tables,
)

__all__ = [
    "IGNORE_INDEX",
    "MODEL_PRESETS",
    "Attention",
    "Block",
    "BlockwiseAttention",
    "FeedForward",
    "RMSNorm",
    "SDPAttention",
    "TokenPositions",
    "Transformer",
    "apply_rotary",
    "flops_per_token",
    "lm_loss",
    "materialize",
    "model_preset",
    "param_count",
    "rope_tables",
]
