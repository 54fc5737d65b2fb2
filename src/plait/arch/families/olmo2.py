"""OLMo 2 (``Olmo2ForCausalLM``): post-norm blocks (``x + norm(f(x))``) and RMSNorm of
queries and keys over the whole projection before RoPE."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plait.arch.families.common import (
    ATTENTION_NAMES,
    MLP_NAMES,
    QK_NORM_NAMES,
    base_config,
    base_fields,
    limits,
)
from plait.arch.spec import FamilySpec, Fields, HFConfig
from plait.config import ModelConfig


def _fields(hf: Mapping[str, Any], source: str) -> Fields:
    base = base_fields(hf, source, SPEC.architecture)
    bias = "qkvo" if hf.get("attention_bias", False) else "none"
    return {
        **base,
        "attention_bias": bias,
        "qk_norm": "projection",
        "norm_placement": "post",
        "arch": "olmo2",
    }


def _config(m: ModelConfig) -> HFConfig:
    return {**base_config(m, SPEC), "attention_bias": m.attention_bias == "qkvo"}


SPEC = FamilySpec(
    name="olmo2",
    architecture="Olmo2ForCausalLM",
    model_type="olmo2",
    features=(
        "post-norm blocks (norm_placement 'post')",
        "q/k RMSNorm over the whole projection (qk_norm 'projection'; its sums of "
        "squares all-reduced over tp)",
    ),
    refuses=(),
    to_fields=_fields,
    to_config=_config,
    names=ATTENTION_NAMES
    + QK_NORM_NAMES
    + MLP_NAMES
    + (
        ("post_attention_layernorm.weight", "attention_norm.weight"),
        ("post_feedforward_layernorm.weight", "ffn_norm.weight"),
    ),
    expresses=limits(
        attention_bias=("none", "qkvo"),
        qk_norm=("projection",),
        norm_placement=("post",),
        sliding_window=(None,),
    ),
)
