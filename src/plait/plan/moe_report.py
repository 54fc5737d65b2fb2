"""``plait plan``'s mixture-of-experts section (the terms of :mod:`plait.plan.moe`)."""

from __future__ import annotations

import argparse

from plait.config import ModelConfig
from plait.plan.layout import Layout
from plait.plan.modelspec import ModelSpec
from plait.plan.moe import MoESpec, format_ep_table
from plait.plan.moe_estimate import ep_row, moe_of
from plait.plan.query import Query


def moe_from_args(ns: argparse.Namespace, spec: ModelSpec) -> MoESpec:
    """The MoE shape of ``--experts --top-k --expert-ffn --shared-experts --moe-every``
    on the dense ``spec`` (read as a model config's ``moe_*`` fields, checked as those)."""
    cfg = ModelConfig(
        dim=spec.hidden,
        n_layers=spec.n_layers,
        n_heads=1,  # the MoE terms read no head
        ffn_dim=spec.ffn_hidden,
        moe_experts=ns.experts,
        moe_top_k=ns.top_k,
        moe_every=ns.moe_every,
        moe_shared_experts=ns.shared_experts,
        moe_hidden_dim=ns.expert_ffn,
    )
    m = MoESpec.from_config(cfg)
    assert m is not None, "moe_from_args needs --experts > 0"
    return m


def moe_section(ns: argparse.Namespace, q: Query, layout: Layout | None = None) -> str:
    """Total vs active parameters and FLOPs of the MoE model of ``q`` (built from the
    ``--experts`` flags), and for ``layout`` (with its ep) the expert terms its estimate
    charges: expert memory per rank and the all-to-all traffic and time per step (None,
    ``--search``: the totals only; ep is one of the searched dimensions, its column in
    the table)."""
    spec, seq, m = q.model, q.seq_len, moe_of(q)
    total = spec.param_count() + m.params_delta(active=False)
    active = spec.param_count() + m.params_delta(active=True)
    flops = spec.flops_per_token(seq) + m.flops_delta_per_token()
    head = [
        "",
        f"mixture of experts: {ns.experts} experts top-{ns.top_k} on {m.moe_layers} of "
        f"{spec.n_layers} layers; {total / 1e9:.3f} B parameters, {active / 1e9:.3f} B "
        f"active per token; {flops / 1e9:.3f} GFLOP/token (MFU counts active)",
    ]
    if layout is None:
        return "\n".join([*head, "(the search tried every ep; the layouts above include it)"])
    return "\n".join(
        [
            *head,
            "(the layout's figures above include the experts at this ep; its expert terms:)",
            format_ep_table([ep_row(q, layout)]),
        ]
    )
