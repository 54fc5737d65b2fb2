"""The mixture-of-experts part of Mixtral's, Qwen2-MoE's and Qwen3-MoE's ``config.json``.

:func:`moe_fields` maps the MoE entries of a ``config.json`` to
:class:`~plait.config.ModelConfig` fields, :func:`moe_config` maps them back: the part
a family spec's ``to_fields`` / ``to_config`` adds to the dense block's (attention,
norms, RoPE). The objective is the family's as ``transformers`` defines it: softmax
over all experts then top-k (``moe_router`` 'softmax'), renormalised always (Mixtral) or
as ``norm_topk_prob`` says (Qwen), the load-balancing loss over every MoE layer
together (``moe_aux_loss_scope`` 'model', ``load_balancing_loss_func``) weighted by
``router_aux_loss_coef``, no z-loss, no capacity (dropless). ``transformers`` adds that
loss to its training loss only when ``output_router_logits`` is true; plait trains with
it whatever that flag says (set ``--model.moe_aux_loss_coef 0`` for the plain
cross-entropy), and the export leaves the flag at ``transformers``' default.

Refused by name: Mixtral's ``router_jitter_noise`` (multiplicative input noise in
training), Qwen's ``mlp_only_layers`` (dense layers at chosen indices: plait places MoE
layers by a period, ``decoder_sparse_step`` = ``moe_every``), and a shared expert whose
width is not a multiple of the routed experts' (plait's shared experts are
``moe_shared_experts`` routed-width SwiGLUs side by side, one wide SwiGLU). The expert
tensors' names and layouts are :mod:`plait.checkpoint.hf_experts`'. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from plait.config import ModelConfig
from plait.config.model import expert_hidden_dim
from plait.errors import ConfigError

MoEFamily = Literal["mixtral", "qwen2_moe", "qwen3_moe"]
"""The ``model_type`` of a supported MoE family."""

EXPERT_STYLE: dict[str, Literal["mixtral", "qwen"]] = {
    "mixtral": "mixtral",
    "qwen2_moe": "qwen",
    "qwen3_moe": "qwen",
}
"""Whose hub names a family's expert tensors carry (:mod:`plait.checkpoint.hf_experts`)."""


def _refuse(source: str, family: str, what: str, why: str) -> ConfigError:
    return ConfigError(f"{source}: {family} with {what} is not supported by plait ({why})")


def _int(cfg: Mapping[str, Any], *keys: str) -> int:
    for k in keys:
        if cfg.get(k) is not None:
            return int(cfg[k])
    raise ConfigError(f"config.json has none of {', '.join(keys)}")


def moe_fields(cfg: Mapping[str, Any], family: MoEFamily, source: str) -> dict[str, Any]:
    """The MoE fields of :class:`ModelConfig` for ``config.json`` ``cfg`` of ``family``
    (ConfigError, naming ``source``: a feature plait does not do)."""
    out: dict[str, Any] = {
        "moe_top_k": int(cfg.get("num_experts_per_tok", 2)),
        "moe_router": "softmax",
        "moe_aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.001)),
        "moe_aux_loss_scope": "model",
        "moe_z_loss_coef": 0.0,
        "moe_capacity_factor": 0.0,
    }
    if family == "mixtral":
        if float(cfg.get("router_jitter_noise") or 0.0) > 0:
            raise _refuse(
                source, family, "router_jitter_noise > 0", "its training-time input noise"
            )
        hidden = _int(cfg, "intermediate_size")
        return out | {
            "moe_experts": _int(cfg, "num_local_experts", "num_experts"),
            "moe_hidden_dim": hidden,
            "ffn_dim": hidden,
            "moe_every": 1,
            "moe_shared_experts": 0,
            "moe_norm_topk_prob": True,
        }
    if cfg.get("mlp_only_layers"):
        raise _refuse(
            source,
            family,
            f"mlp_only_layers {list(cfg['mlp_only_layers'])}",
            "plait places MoE layers every decoder_sparse_step layers only",
        )
    hidden = _int(cfg, "moe_intermediate_size")
    out |= {
        "moe_experts": _int(cfg, "num_experts", "num_local_experts"),
        "moe_hidden_dim": hidden,
        "moe_every": int(cfg.get("decoder_sparse_step") or 1),
        "moe_norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "moe_shared_experts": 0,
        "moe_shared_expert_gate": False,
    }
    if cfg.get("intermediate_size") is not None:  # the dense layers' width
        out["ffn_dim"] = int(cfg["intermediate_size"])
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if family == "qwen2_moe":
        if shared == 0 or shared % hidden:
            raise _refuse(
                source,
                family,
                f"shared_expert_intermediate_size {shared}",
                f"not a positive multiple of moe_intermediate_size {hidden}",
            )
        out["moe_shared_experts"] = shared // hidden
        out["moe_shared_expert_gate"] = True
    return out


def moe_config(m: ModelConfig, family: MoEFamily) -> dict[str, Any]:
    """The MoE entries of ``family``'s ``config.json`` for ``m`` (ConfigError: ``m`` has
    an MoE feature the family cannot express)."""
    expresses = {
        "moe_router": (m.moe_router, "softmax"),
        "moe_aux_loss_scope": (m.moe_aux_loss_scope, "model"),
        "moe_z_loss_coef": (m.moe_z_loss_coef, 0.0),
        "moe_capacity_factor": (m.moe_capacity_factor, 0.0),
    }
    if family == "mixtral":
        expresses |= {
            "moe_every": (m.moe_every, 1),
            "moe_shared_experts": (m.moe_shared_experts, 0),
            "moe_norm_topk_prob": (m.moe_norm_topk_prob, True),
        }
    else:
        qwen2 = family == "qwen2_moe"  # always a gated shared expert; Qwen3-MoE none
        expresses["moe_shared_expert_gate"] = (m.moe_shared_expert_gate, qwen2)
        expresses["moe_shared_experts > 0"] = (m.moe_shared_experts > 0, qwen2)
    for name, (have, want) in expresses.items():
        if have != want:
            raise ConfigError(f"{family} cannot express model.{name} = {have!r} (it has {want!r})")
    hidden = expert_hidden_dim(m)
    out: dict[str, Any] = {
        "num_experts_per_tok": m.moe_top_k,
        "router_aux_loss_coef": m.moe_aux_loss_coef,
    }
    if family == "mixtral":
        if hidden != m.hidden_dim:
            raise ConfigError(
                f"mixtral has one intermediate_size: model.moe_hidden_dim ({hidden}) must "
                f"equal the dense width ({m.hidden_dim})"
            )
        return out | {"num_local_experts": m.moe_experts, "intermediate_size": hidden}
    out |= {
        "num_experts": m.moe_experts,
        "moe_intermediate_size": hidden,
        "intermediate_size": m.hidden_dim,
        "decoder_sparse_step": m.moe_every,
        "mlp_only_layers": [],
        "norm_topk_prob": m.moe_norm_topk_prob,
    }
    if family == "qwen2_moe":
        out["shared_expert_intermediate_size"] = m.moe_shared_experts * hidden
    return out
