"""Phi-3 (``Phi3ForCausalLM``): Llama's block with q/k/v fused into ``qkv_proj`` and
gate/up into ``gate_up_proj``; split on import, fused back on export."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plait.arch.families.common import (
    PRE_NORM_NAMES,
    base_config,
    base_fields,
    limits,
    window_config,
    window_fields,
)
from plait.arch.spec import FamilySpec, Fields, HFConfig, refuse
from plait.config import ModelConfig


def _fields(hf: Mapping[str, Any], source: str) -> Fields:
    base = base_fields(hf, source, SPEC.architecture)
    if base["head_width"] is not None:
        raise refuse(source, SPEC.architecture, "head_dim", "Phi-3 derives it from hidden_size")
    return {**base, **window_fields(hf, gated=False), "arch": "phi3"}


def _config(m: ModelConfig) -> HFConfig:
    out = {**base_config(m, SPEC), **window_config(m, gated=False)}
    out.pop("head_dim")
    out["rope_parameters"] = {**out["rope_parameters"], "partial_rotary_factor": 1.0}
    return {**out, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0}


SPEC = FamilySpec(
    name="phi3",
    architecture="Phi3ForCausalLM",
    model_type="phi3",
    features=(
        "Llama's block; qkv_proj and gate_up_proj fused in the files (split on import)",
        "sliding_window: every layer",
    ),
    refuses=("partial_rotary_factor below 1 and longrope (Phi-3 128k): not implemented",),
    to_fields=_fields,
    to_config=_config,
    names=(
        ("self_attn.o_proj.weight", "attention.wo.weight"),
        ("mlp.down_proj.weight", "feed_forward.w2.weight"),
        *PRE_NORM_NAMES,
    ),
    fused=(
        (
            "self_attn.qkv_proj.weight",
            ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"),
        ),
        ("mlp.gate_up_proj.weight", ("feed_forward.w1.weight", "feed_forward.w3.weight")),
    ),
    expresses=limits(
        attention_bias=("none",), qk_norm=("none",), norm_placement=("pre",), head_width=(None,)
    ),
)
