"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's block (per-head q/k RMSNorm, its own
``head_dim``) with a mixture of experts every ``decoder_sparse_step`` layers and no
shared expert; top-k renormalised as ``norm_topk_prob`` says."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plait.arch.families.common import (
    ATTENTION_NAMES,
    MLP_NAMES,
    PRE_NORM_NAMES,
    QK_NORM_NAMES,
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
    moe = moe_checked(lambda: moe_fields(hf, "qwen3_moe", source), source)
    bias = "qkvo" if hf.get("attention_bias", False) else "none"
    window = window_fields(hf, gated=True)
    return {
        **base,
        **window,
        **moe,
        "attention_bias": bias,
        "qk_norm": "head",
        "arch": "qwen3-moe",
    }


def _config(m: ModelConfig) -> HFConfig:
    out = {**base_config(m, SPEC), **window_config(m, gated=True), **moe_config(m, "qwen3_moe")}
    return {**out, "attention_bias": m.attention_bias == "qkvo", "output_router_logits": False}


SPEC = FamilySpec(
    name="qwen3-moe",
    architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    features=(
        "Qwen3's block (q/k RMSNorm per head, head_dim) with an MoE feed-forward every "
        "decoder_sparse_step layers (moe_every), dense MLPs between; no shared expert",
        "softmax router, norm_topk_prob; load-balancing loss over all MoE layers "
        "weighted by router_aux_loss_coef; --ep splits the experts",
    ),
    refuses=("mlp_only_layers (plait places MoE layers by a period only)",),
    to_fields=_fields,
    to_config=_config,
    names=ATTENTION_NAMES + QK_NORM_NAMES + MLP_NAMES + PRE_NORM_NAMES + QWEN_MOE_NAMES,
    expresses=moe_expresses(
        limits(attention_bias=("none", "qkvo"), qk_norm=("head",), norm_placement=("pre",)),
        "qwen3_moe",
    ),
    experts="qwen",
)
