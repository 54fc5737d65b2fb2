"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama's block with q/k/v biases; a sliding
window on the layers from ``max_window_layers`` on when ``use_sliding_window``."""

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
    window_config,
    window_fields,
)
from plait.arch.spec import FamilySpec, Fields, HFConfig
from plait.config import ModelConfig


def _fields(hf: Mapping[str, Any], source: str) -> Fields:
    base = base_fields(hf, source, SPEC.architecture)
    window = window_fields(hf, gated=True)
    return {**base, **window, "attention_bias": "qkv", "arch": "qwen2"}


def _config(m: ModelConfig) -> HFConfig:
    return {**base_config(m, SPEC), **window_config(m, gated=True)}


SPEC = FamilySpec(
    name="qwen2",
    architecture="Qwen2ForCausalLM",
    model_type="qwen2",
    features=(
        "Llama's block with q/k/v projection biases (attention_bias 'qkv')",
        "sliding_window on layers >= max_window_layers when use_sliding_window",
    ),
    refuses=(),
    to_fields=_fields,
    to_config=_config,
    names=ATTENTION_NAMES + MLP_NAMES + PRE_NORM_NAMES,
    expresses=limits(attention_bias=("qkv",), qk_norm=("none",), norm_placement=("pre",)),
)
