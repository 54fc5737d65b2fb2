"""Families plait knows by name and does not load yet, each with the reason."""

from __future__ import annotations

from plait.arch.spec import Refused

_GEMMA = (
    "its block needs the (1 + w) RMSNorm gain, the sqrt(hidden_size) embedding scale and "
    "GeGLU (gelu_pytorch_tanh), which plait's transformer does not have yet"
)
_GEMMA2 = (
    _GEMMA + ", and attention/final logit soft-capping, pre- and post-block norms and "
    "query_pre_attn_scalar"
)

REFUSED: tuple[Refused, ...] = (
    Refused("gemma", "GemmaForCausalLM", "gemma", _GEMMA),
    Refused("gemma2", "Gemma2ForCausalLM", "gemma2", _GEMMA2),
    Refused("gemma3", "Gemma3ForCausalLM", "gemma3_text", _GEMMA2 + ", and per-layer-type RoPE"),
    Refused(
        "gemma3-vlm",
        "Gemma3ForConditionalGeneration",
        "gemma3",
        "it is a vision-language model; plait takes text models only",
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
