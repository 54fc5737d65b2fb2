"""Architectures by shape, without torch: what the model and the planner both count.

The layer between :mod:`plait.config` and :mod:`plait.comm`: it imports only
:mod:`plait.errors` and :mod:`plait.config`, and no torch, so the built-in model
(:mod:`plait.model`) and the planner (:mod:`plait.plan`, which runs where torch is not
installed) share one copy of the arithmetic (:mod:`plait.arch.arithmetic`: parameters,
FLOPs per token, active parameters of a mixture of experts). Per-family architecture
specs belong here too.
"""

from __future__ import annotations

from plait.arch.arithmetic import (
    SWIGLU_MATS,
    active_param_count,
    attention_flops_per_token,
    attention_params,
    block_matmul_params,
    block_vector_params,
    flops_per_token,
    mlp_params,
    moe_ffn_params,
    param_count,
    training_flops_per_token,
)

__all__ = [
    "SWIGLU_MATS",
    "active_param_count",
    "attention_flops_per_token",
    "attention_params",
    "block_matmul_params",
    "block_vector_params",
    "flops_per_token",
    "mlp_params",
    "moe_ffn_params",
    "param_count",
    "training_flops_per_token",
]
