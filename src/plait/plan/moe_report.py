"""``plait plan``'s mixture-of-experts section (the terms of :mod:`plait.plan.moe`)."""

from __future__ import annotations

import argparse

from plait.errors import ConfigError
from plait.plan.hardware import Hardware
from plait.plan.layout import Precision
from plait.plan.modelspec import ModelSpec
from plait.plan.moe import MoESpec, ep_table, format_ep_table


def moe_from_args(ns: argparse.Namespace, spec: ModelSpec) -> MoESpec:
    """The MoE shape of ``--experts --top-k --expert-ffn --shared-experts --moe-every``
    on the dense ``spec``."""
    layers = sum(1 for i in range(spec.n_layers) if (i + 1) % ns.moe_every == 0)
    width = ns.expert_ffn or max(1, spec.ffn_hidden // ns.top_k)
    return MoESpec(
        spec.hidden, ns.experts, ns.top_k, width, ns.shared_experts, layers, spec.ffn_hidden,
        spec.n_layers,
    )  # fmt: skip


def moe_section(
    ns: argparse.Namespace,
    spec: ModelSpec,
    hw: Hardware,
    prec: Precision,
    data_ranks: int,
    tp: int,
    pp: int,
    global_batch: int,
    seq: int,
    search: bool = False,
) -> str:
    """Total vs active parameters and FLOPs of the MoE model built from the dense
    ``spec`` and the ``--experts`` flags, and for the layout's ep: expert memory per rank
    and the all-to-all traffic and time per step (``--search``: the totals only; ep is
    one of the searched dimensions, its column in the table)."""
    m = moe_from_args(ns, spec)
    layers = m.moe_layers
    if not search and (data_ranks % ns.ep or ns.experts % ns.ep):
        raise ConfigError(
            f"--ep {ns.ep} must divide the data ranks dp x cp = {data_ranks} and the "
            f"{ns.experts} experts."
        )
    total = spec.param_count() + m.params_delta(active=False)
    active = spec.param_count() + m.params_delta(active=True)
    flops = spec.flops_per_token(seq) + m.flops_delta_per_token()
    link = hw.intra if ns.ep * tp <= hw.devices_per_node else hw.inter
    tokens = global_batch * seq // data_ranks
    rows = ep_table(
        m, data_ranks, tokens, prec.activation_bytes, prec.state_bytes_per_param,
        link.latency_s, link.bandwidth, pp,
    )  # fmt: skip
    head = [
        "",
        f"mixture of experts: {ns.experts} experts top-{ns.top_k} on {layers} of "
        f"{spec.n_layers} layers; {total / 1e9:.3f} B parameters, {active / 1e9:.3f} B "
        f"active per token; {flops / 1e9:.3f} GFLOP/token (MFU counts active)",
    ]
    if search:
        return "\n".join([*head, "(the search tried every ep; the layouts above include it)"])
    rows = [r for r in rows if r[0] == ns.ep]
    return "\n".join(
        [
            *head,
            "(the layout's figures above include the experts at this ep; its expert terms:)",
            format_ep_table(rows),
        ]
    )
