"""Qwen2-MoE / Qwen1.5-MoE (``Qwen2MoeForCausalLM``): Qwen2's block (q/k/v biases) with
a mixture of experts every ``decoder_sparse_step`` layers and a shared expert scaled by
``sigmoid(x · shared_expert_gate)``; top-k renormalised as ``norm_topk_prob`` says."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plait.arch.families.common import (
    ATTENTION_NAMES,
    MLP_NAMES,
    PRE_NORM_NAMES,
    QWEN_MOE_NAMES,
    base_config,
    base_fields,
    limits,
    moe_checked,
    moe_expresses,
    window_config,
    window_fields,
)
from plait.arch.moe_hf import moe_config, moe_fields
from plait.arch.spec import FamilySpec, Fields, HFConfig
from plait.config import ModelConfig


def _fields(hf: Mapping[str, Any], source: str) -> Fields:
    base = base_fields(hf, source, SPEC.architecture)
    moe = moe_checked(lambda: moe_fields(hf, "qwen2_moe", source), source)
    bias = "qkv" if hf.get("qkv_bias", True) else "none"
    window = window_fields(hf, gated=True)
    return {**base, **window, **moe, "attention_bias": bias, "arch": "qwen2-moe"}


def _config(m: ModelConfig) -> HFConfig:
    out = {**base_config(m, SPEC), **window_config(m, gated=True), **moe_config(m, "qwen2_moe")}
    if m.sliding_window is None:  # transformers' Qwen2MoeConfig writes 0 when unused
        out["sliding_window"] = 0
    return {**out, "qkv_bias": m.attention_bias == "qkv", "output_router_logits": False}


SPEC = FamilySpec(
    name="qwen2-moe",
    architecture="Qwen2MoeForCausalLM",
    model_type="qwen2_moe",
    features=(
        "Qwen2's block (q/k/v biases: qkv_bias) with an MoE feed-forward every "
        "decoder_sparse_step layers (moe_every), dense MLPs between",
        "a shared expert (moe_shared_experts = shared width / expert width) times "
        "sigmoid(x . shared_expert_gate) (moe_shared_expert_gate)",
        "softmax router, norm_topk_prob; load-balancing loss over all MoE layers "
        "weighted by router_aux_loss_coef; --ep splits the experts",
    ),
    refuses=(
        "mlp_only_layers (plait places MoE layers by a period only)",
        "a shared_expert_intermediate_size that is not a multiple of moe_intermediate_size",
    ),
    to_fields=_fields,
    to_config=_config,
    names=ATTENTION_NAMES + MLP_NAMES + PRE_NORM_NAMES + QWEN_MOE_NAMES,
    expresses=moe_expresses(
        limits(attention_bias=("qkv", "none"), qk_norm=("none",), norm_placement=("pre",)),
        "qwen2_moe",
    ),
    experts="qwen",
)
