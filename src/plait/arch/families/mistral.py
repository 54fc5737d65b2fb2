"""Mistral (``MistralForCausalLM``): Llama's block with a sliding attention window."""

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
    return {**base, **window_fields(hf, gated=False), "arch": "mistral"}


def _config(m: ModelConfig) -> HFConfig:
    return {**base_config(m, SPEC), **window_config(m, gated=False)}


SPEC = FamilySpec(
    name="mistral",
    architecture="MistralForCausalLM",
    model_type="mistral",
    features=("Llama's block", "sliding_window: every layer sees the last W keys"),
    refuses=(),
    to_fields=_fields,
    to_config=_config,
    names=ATTENTION_NAMES + MLP_NAMES + PRE_NORM_NAMES,
    expresses=limits(attention_bias=("none",), qk_norm=("none",), norm_placement=("pre",)),
)
