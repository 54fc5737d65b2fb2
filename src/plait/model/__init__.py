"""The built-in decoder-only transformer (its size and FLOP arithmetic: :mod:`plait.arch`)."""

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
    lm_loss,
    materialize,
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
    "lm_loss",
    "materialize",
    "model_preset",
    "rope_tables",
]
