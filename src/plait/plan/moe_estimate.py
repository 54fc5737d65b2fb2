"""One layout of a mixture-of-experts model: the dense estimate plus the MoE terms.

The planner's dense model (:mod:`plait.plan.estimate`) is the MoE model with every
feed-forward a dense SwiGLU of width ``f``. :func:`moe_memory` and :func:`moe_estimate`
replace, on each MoE layer of the worst stage (``ceil(moe_layers / pp)`` of them), that
SwiGLU (split by tp) with the MoE feed-forward (:class:`~plait.plan.moe.MoESpec`):

* **memory**: the router ``(E, h)`` and the ``s`` shared experts are held like dense
  weights (ZeRO shards them over the layout's F ranks); the rank's ``E/ep`` routed
  experts are whole (tp does not split them) and ZeRO shards their weights, gradients
  and optimizer state over the expert replica group of ``dp·cp/ep`` ranks (the ranks
  that hold the same experts); activations: per token ``k`` routed rows and the shared
  experts' rows each save a SwiGLU's tensors of width ``f_e`` (gate, up, down input and,
  unfused, silu), plus the dispatched input and the combined output rows (``2·k·h``)
  and the router's logits and probabilities (``2·E``), instead of the dense SwiGLU's;
* **time**, per micro-batch and MoE layer: the router GEMM ``(T, h, E)``, each of the
  rank's ``E/ep`` experts a SwiGLU on its ``T·k·ep/E`` rows (a balanced router: the
  rank's experts receive ``T·k`` rows in all from the ``ep`` ranks), the shared experts
  on ``T`` rows, instead of the dense SwiGLU (backward twice forward, GEMMs at the
  profile's rate for their size, :data:`EXPERT_OPS` operator calls per expert); the
  all-to-alls of :meth:`MoESpec.a2a_seconds_per_layer` (``ep_comm``), also in the
  bubble; the data-parallel traffic and the optimizer scaled by the gradient bytes each
  group reduces (experts over ``dp·cp/ep`` ranks, the rest over ``dp·cp``) and the
  parameters each rank updates.

MFU counts active parameters (:attr:`Estimate.moe`). The dense estimate's other terms
(attention, norms, tensor/context/pipeline traffic) are unchanged.
"""

from __future__ import annotations

import math
from dataclasses import replace

from plait.errors import ConfigError
from plait.plan.compute import BACKWARD_FACTOR, Gemm
from plait.plan.estimate import Estimate, estimate
from plait.plan.hardware import Hardware, Link
from plait.plan.layout import Layout, Precision
from plait.plan.memory import MemoryBreakdown, memory_per_rank, stage_params
from plait.plan.modelspec import ModelSpec
from plait.plan.moe import MoESpec
from plait.plan.query import Query

EXPERT_OPS = 8
"""Operator calls per expert and micro-batch in forward besides its three GEMMs: the
gather of its rows, silu, the product, the weighted scatter back, views (backward
pays twice, as the planner charges every operator)."""


def expert_replicas(layout: Layout) -> int:
    """Ranks that hold the same experts (ZeRO shards expert state over them): dp·cp/ep."""
    return layout.dp * layout.cp // layout.ep


def check_ep(moe: MoESpec, layout: Layout) -> str | None:
    """Why ``layout.ep`` cannot split ``moe``'s experts, or None."""
    if moe.experts % layout.ep:
        return f"ep={layout.ep} does not divide the {moe.experts} experts"
    if (layout.dp * layout.cp) % layout.ep:
        return f"ep={layout.ep} does not divide dp x cp = {layout.dp * layout.cp}"
    return None


def ep_choices(moe: MoESpec, layout: Layout) -> list[int]:
    """Every ep that divides both dp·cp and the experts, increasing."""
    n = layout.dp * layout.cp
    return [e for e in range(1, n + 1) if n % e == 0 and moe.experts % e == 0]


def moe_layers_on_stage(moe: MoESpec, pp: int) -> int:
    """MoE layers on the pipeline stage that holds the most (evenly spread)."""
    return math.ceil(moe.moe_layers / pp)


def _held(params: float, shards: int, zero: int, pr: Precision) -> tuple[float, ...]:
    """(weights, gradients, master, optimizer) bytes of ``params`` under ZeRO ``zero``
    over ``shards`` ranks."""
    sh = math.ceil(params / shards) if shards > 1 else params
    return (
        (sh if zero >= 3 else params) * pr.param_bytes,
        (sh if zero >= 2 else params) * pr.grad_bytes,
        (sh if zero >= 1 else params) * pr.master_bytes,
        (sh if zero >= 1 else params) * pr.optimizer_bytes,
    )


def _routed(moe: MoESpec, layout: Layout) -> int:
    """Routed-expert weights of one MoE layer on one rank: its ``E/ep`` experts, whole."""
    return moe.experts // layout.ep * moe.expert_params


def _ffn_params(spec: ModelSpec, moe: MoESpec, layout: Layout) -> tuple[float, float, float]:
    """Per MoE layer on one rank: (dense SwiGLU replaced, router + shared, routed experts)."""
    dense = spec.mlp_mats * spec.hidden * (spec.ffn_hidden // layout.tp)
    kept = moe.hidden * moe.experts + moe.shared * moe.expert_params
    return float(dense), float(kept), float(_routed(moe, layout))


def moe_of(q: Query) -> MoESpec:
    """The MoE part of ``q``'s model; a dense query is refused."""
    if q.moe is None:
        raise ConfigError(f"{q.model.name} is a dense model: the query has no MoE part.")
    return q.moe


def _act_delta(q: Query, layout: Layout) -> float:
    """Activation bytes one MoE layer saves for one micro-batch, minus the dense SwiGLU's."""
    spec, moe, pr, rt, seq = q.model, moe_of(q), q.precision, q.runtime, q.seq_len
    tokens = layout.micro_batch * seq / layout.cp
    per_row = 3 + (0 if rt.fused_swiglu else 1)  # gate, up, down input (+ silu)
    dense = per_row * spec.ffn_hidden / layout.tp
    moe_rows = (moe.top_k + moe.shared) * per_row * moe.expert_hidden
    per_token = moe_rows + 2 * moe.top_k * moe.hidden + 2 * moe.experts - dense
    return tokens * per_token * pr.activation_bytes


def expert_held(moe: MoESpec, layout: Layout, pr: Precision) -> tuple[float, ...]:
    """(weights, gradients, master, optimizer) bytes of the routed experts on the worst
    stage's rank: its ``E/ep`` experts of each of its MoE layers, ZeRO-sharded over the
    ``dp·cp/ep`` expert replicas (the expert terms of :func:`moe_memory`)."""
    n = moe_layers_on_stage(moe, layout.pp)
    return _held(n * _routed(moe, layout), expert_replicas(layout), layout.zero, pr)


def moe_memory(q: Query, layout: Layout) -> MemoryBreakdown:
    """The worst rank's memory of the MoE model under ``layout`` (module doc)."""
    spec, moe, pr = q.model, moe_of(q), q.precision
    if check_ep(moe, layout):
        raise ConfigError(f"layout {layout.describe()}: {check_ep(moe, layout)}.")
    mem = memory_per_rank(q, layout)
    n = moe_layers_on_stage(moe, layout.pp)
    dense, kept, _ = _ffn_params(spec, moe, layout)
    f = layout.shard_factor
    minus = _held(n * dense, f, layout.zero, pr)
    plus = _held(n * kept, f, layout.zero, pr)
    experts = expert_held(moe, layout, pr)
    w, g, m, o = (plus[i] + experts[i] - minus[i] for i in range(4))
    act = n * mem.in_flight * _act_delta(q, layout)
    return replace(
        mem,
        params=mem.params + w,
        grads=mem.grads + g,
        master=mem.master + m,
        optimizer=mem.optimizer + o,
        activations=max(0.0, mem.activations + act),
    )


def _swiglu(rows: float, h: float, width: float, hw: Hardware) -> float:
    """Forward seconds of one SwiGLU (three GEMMs) on ``rows`` rows."""
    if rows <= 0:
        return 0.0
    return 2 * Gemm("w1", rows, h, width).seconds(hw) + Gemm("w2", rows, width, h).seconds(hw)


def moe_layer_seconds(q: Query, layout: Layout) -> float:
    """Compute seconds (forward + backward) one MoE layer adds over the dense SwiGLU for
    one micro-batch on one rank (negative when the experts are cheaper)."""
    spec, moe, hw = q.model, moe_of(q), q.hardware
    tokens = layout.micro_batch * q.seq_len / layout.cp
    h = float(moe.hidden)
    local = moe.experts // layout.ep
    rows = tokens * moe.top_k * layout.ep / moe.experts  # per expert, balanced router
    fwd = Gemm("router", tokens, h, moe.experts).seconds(hw)
    fwd += local * (_swiglu(rows, h, moe.expert_hidden, hw) + EXPERT_OPS * hw.op_overhead_s)
    fwd += moe.shared * _swiglu(tokens, h, moe.expert_hidden, hw)
    f = spec.ffn_hidden / layout.tp
    dense = (spec.mlp_mats - 1) * Gemm("up", tokens, h, f).seconds(hw)
    dense += Gemm("down", tokens, f, h).seconds(hw)
    return (1 + BACKWARD_FACTOR) * (fwd - dense)


def ep_link(layout: Layout, hw: Hardware) -> Link:
    """The link the ep group spans: intra-node while ``ep·tp`` ranks fit one node."""
    return hw.intra if layout.ep * layout.tp <= hw.devices_per_node else hw.inter


def a2a_layer_seconds(q: Query, layout: Layout) -> float:
    """One MoE layer's all-to-alls (forward and backward) for one micro-batch."""
    tokens = int(layout.micro_batch * q.seq_len / layout.cp)
    link = ep_link(layout, q.hardware)
    return moe_of(q).a2a_seconds_per_layer(
        tokens, layout.ep, q.precision.activation_bytes, link.latency_s, link.bandwidth
    )


def ep_row(q: Query, layout: Layout) -> tuple[int, float, float, float]:
    """``(ep, expert bytes per rank, all-to-all bytes per step, all-to-all seconds per
    step)`` of ``layout`` on the worst stage: the expert terms :func:`moe_memory` and
    :func:`moe_estimate` (its ``ep_comm``) charge, for ``plait plan``'s MoE section."""
    moe, pr = moe_of(q), q.precision
    if check_ep(moe, layout):
        raise ConfigError(f"layout {layout.describe()}: {check_ep(moe, layout)}.")
    n, m = moe_layers_on_stage(moe, layout.pp), layout.microbatches
    tokens = int(layout.micro_batch * q.seq_len / layout.cp)
    traffic = m * n * moe.a2a_bytes_per_layer(tokens, layout.ep, pr.activation_bytes)
    secs = m * n * a2a_layer_seconds(q, layout)
    return layout.ep, sum(expert_held(moe, layout, pr)), traffic, secs


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def moe_estimate(q: Query, layout: Layout) -> Estimate:
    """The estimate of ``layout`` for the MoE model of ``q`` (module doc)."""
    spec, moe = q.model, moe_of(q)
    dense = estimate(q, layout)
    mem = moe_memory(q, layout)
    t = dense.time
    n, m = moe_layers_on_stage(moe, layout.pp), layout.microbatches
    comp = n * moe_layer_seconds(q, layout)
    a2a = n * a2a_layer_seconds(q, layout)
    bubble = 0.0
    if layout.pp > 1:
        slots = (layout.pp - 1) / (layout.chunks if layout.schedule == "interleaved" else 1)
        bubble = slots * (comp + a2a)
    # gradient bytes each group reduces, weighted by the ring's (n-1)/n; updated params
    p_dense = float(stage_params(spec, layout, 0).params)
    d_ffn, kept, routed = _ffn_params(spec, moe, layout)
    p_rest = max(0.0, p_dense + n * (kept - d_ffn))
    dpcp, rep = layout.dp * layout.cp, expert_replicas(layout)
    base = p_dense * _ring(dpcp)
    dp_scale = (p_rest * _ring(dpcp) + n * routed * _ring(rep)) / base if base else 0.0
    f = layout.shard_factor if layout.zero >= 1 else 1
    opt_scale = (p_rest / f + n * routed / (rep if layout.zero >= 1 else 1)) / (p_dense / f)
    time = replace(
        t,
        compute=max(0.0, t.compute + m * comp),
        bubble=t.bubble + bubble,
        dp_comm=t.dp_comm * dp_scale,
        dp_comm_total=t.dp_comm_total * dp_scale,
        optimizer=t.optimizer * opt_scale,
        ep_comm=m * a2a,
    )
    return replace(dense, memory=mem, time=time, moe=moe)
