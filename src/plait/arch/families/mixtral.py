"""Mixtral (``MixtralForCausalLM``): Mistral's block with a mixture of experts on every
layer (softmax router, top-k renormalised, the model-wide load-balancing loss weighted
by ``router_aux_loss_coef``); the experts' hub names ``block_sparse_moe.experts.{e}.
w1/w3/w2`` (or ``transformers`` 5's fused ``mlp.experts.gate_up_proj``/``down_proj``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plait.arch.families.common import (
    ATTENTION_NAMES,
    PRE_NORM_NAMES,
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
    moe = moe_checked(lambda: moe_fields(hf, "mixtral", source), source)
    return {**base, **window_fields(hf, gated=False), **moe, "arch": "mixtral"}


def _config(m: ModelConfig) -> HFConfig:
    out = {**base_config(m, SPEC), **window_config(m, gated=False), **moe_config(m, "mixtral")}
    if m.head_width is None:  # transformers' MixtralConfig: None, hidden / heads derived
        out["head_dim"] = None
    return {**out, "router_jitter_noise": 0.0, "output_router_logits": False}


SPEC = FamilySpec(
    name="mixtral",
    architecture="MixtralForCausalLM",
    model_type="mixtral",
    features=(
        "Mistral's block (sliding_window) with an MoE feed-forward on every layer: "
        "softmax router, top-k renormalised, no shared expert",
        "load-balancing loss over all MoE layers (moe_aux_loss_scope 'model') weighted by "
        "router_aux_loss_coef; no z-loss; dropless; --ep splits the experts",
        "experts: hub per-expert w1/w3/w2 or transformers 5's fused gate_up_proj/down_proj",
    ),
    refuses=("router_jitter_noise > 0 (its training-time input noise)",),
    to_fields=_fields,
    to_config=_config,
    names=ATTENTION_NAMES
    + PRE_NORM_NAMES
    + (("block_sparse_moe.gate.weight", "feed_forward.router.gate.weight"),),
    expresses=moe_expresses(
        limits(attention_bias=("none",), qk_norm=("none",), norm_placement=("pre",)), "mixtral"
    ),
    experts="mixtral",
)
