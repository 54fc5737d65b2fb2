"""Families plait knows by name and does not load yet, each with the reason."""

from __future__ import annotations

from plait.arch.spec import Refused

_GEMMA = (
    "Gemma 1 has no spec yet (its block is Gemma 2's without the post-sublayer norms, "
    "soft-capping and windows); Gemma 2 and 3 load"
)

REFUSED: tuple[Refused, ...] = (
    Refused("gemma", "GemmaForCausalLM", "gemma", _GEMMA),
    Refused(
        "gemma3-vlm",
        "Gemma3ForConditionalGeneration",
        "gemma3",
        "it is a vision-language model; plait takes text models only (save its "
        "language model as a Gemma3ForCausalLM folder: model_type gemma3_text)",
    ),
    Refused(
        "deepseek-v3",
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        "its multi-head latent attention (low-rank compressed q/kv with a decoupled RoPE "
        "head) is not plait's attention",
    ),
    Refused(
        "phi",
        "PhiForCausalLM",
        "phi",
        "Phi-1/2 use LayerNorm with biases, a parallel attention/MLP block and partial RoPE",
    ),
)
"""The known families plait refuses (``plait models`` lists them)."""
