"""Qwen3 (``Qwen3ForCausalLM``): Llama's block with a per-head RMSNorm of queries and
keys before RoPE and its own head width (``head_dim``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plait.arch.families.common import (
    ATTENTION_NAMES,
    MLP_NAMES,
    PRE_NORM_NAMES,
    QK_NORM_NAMES,
    base_config,
    base_fields,
    limits,
    window_config,
    window_fields,
)
from plait.arch.spec import FamilySpec, Fields, HFConfig
from plait.config import ModelConfig


def _fields(hf: Mapping[str, Any], source: str) -> Fields:
    base = base_fields(hf, source, SPEC.architecture)
    bias = "qkvo" if hf.get("attention_bias", False) else "none"
    window = window_fields(hf, gated=True)
    return {**base, **window, "attention_bias": bias, "qk_norm": "head", "arch": "qwen3"}


def _config(m: ModelConfig) -> HFConfig:
    out = {**base_config(m, SPEC), **window_config(m, gated=True)}
    return {**out, "attention_bias": m.attention_bias == "qkvo"}


SPEC = FamilySpec(
    name="qwen3",
    architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    features=(
        "Llama's block with q/k RMSNorm per head (qk_norm 'head')",
        "head_dim other than hidden_size / heads (head_width)",
        "attention_bias: biases on q/k/v/o",
    ),
    refuses=(),
    to_fields=_fields,
    to_config=_config,
    names=ATTENTION_NAMES + QK_NORM_NAMES + MLP_NAMES + PRE_NORM_NAMES,
    expresses=limits(attention_bias=("none", "qkvo"), qk_norm=("head",), norm_placement=("pre",)),
)
