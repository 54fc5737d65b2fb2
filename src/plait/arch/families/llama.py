"""Llama (``LlamaForCausalLM``): plait's own block, names mapped one to one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plait.arch.families.common import (
    ATTENTION_NAMES,
    MLP_NAMES,
    PRE_NORM_NAMES,
    base_config,
    base_fields,
    limits,
)
from plait.arch.spec import FamilySpec, Fields, HFConfig
from plait.config import ModelConfig


def _fields(hf: Mapping[str, Any], source: str) -> Fields:
    bias = "qkvo" if hf.get("attention_bias", False) else "none"
    return {**base_fields(hf, source, SPEC.architecture), "attention_bias": bias, "arch": "llama"}


def _config(m: ModelConfig) -> HFConfig:
    return {**base_config(m, SPEC), "attention_bias": m.attention_bias == "qkvo", "mlp_bias": False}


SPEC = FamilySpec(
    name="llama",
    architecture="LlamaForCausalLM",
    model_type="llama",
    features=(
        "RMSNorm pre-norm, GQA, rotate-half RoPE (linear, llama3 scaling), SwiGLU",
        "attention_bias: biases on q/k/v/o",
    ),
    refuses=("MLP biases (plait's MLP has none)",),
    to_fields=_fields,
    to_config=_config,
    names=ATTENTION_NAMES + MLP_NAMES + PRE_NORM_NAMES,
    expresses=limits(
        attention_bias=("none", "qkvo"),
        qk_norm=("none",),
        norm_placement=("pre",),
        sliding_window=(None,),
    ),
)
