"""Named model shapes that plait's built-in transformer builds: one table for everyone.

:data:`MODEL_PRESETS` is plain data in the config layer (no torch): the model
(:func:`plait.model.model_preset`) builds from it and the planner
(:data:`plait.plan.MODEL_PRESETS`) derives its specs of these names from it, so a name
means one shape everywhere. The planner adds published architectures plait does not
build (GPT-2/3 with GELU MLPs and learned positions, larger Llamas) under their own
names.
"""

from __future__ import annotations

import dataclasses

from plait.config import ModelConfig
from plait.errors import ConfigError

MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64
    ),
    "small": ModelConfig(),
    # GPT-2 small's sizes built as plait's llama-style transformer (RoPE, SwiGLU; ffn 2048
    # = 8/3·768 gives the SwiGLU MLP the 4·h GELU MLP's size; vocabulary padded to a
    # multiple of 64). The planner's "gpt2-124m" is GPT-2 itself (GELU, learned positions).
    "gpt2-124m-llama": ModelConfig(
        vocab_size=50304,
        dim=768,
        n_layers=12,
        n_heads=12,
        ffn_dim=2048,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    "llama2-7b": ModelConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, max_seq_len=4096
    ),
    "llama3-8b": ModelConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}
"""Named model shapes. Use :func:`model_preset` to get a private copy."""


def model_preset(name: str) -> ModelConfig:
    """A copy of the preset ``name`` from :data:`MODEL_PRESETS`."""
    if name not in MODEL_PRESETS:
        raise ConfigError(
            f"unknown model preset {name!r}; choose one of {', '.join(sorted(MODEL_PRESETS))}."
        )
    return dataclasses.replace(MODEL_PRESETS[name])
