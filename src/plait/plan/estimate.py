"""One layout, one verdict: memory per rank, step time by component, tokens/s and MFU.

Step time of the slowest pipeline stage (Narayanan et al. 2021, section 3)::

    t_mb  = forward + backward + recomputation            (compute, one micro-batch)
          + tensor-parallel all-reduces                    (critical path: 2 forward and
            2 backward per block, 2 more with full recomputation; Shoeybi et al. 2019)
          + exposed context-parallel traffic    (ring: max(0, comm - attention); all-to-all)
          + pipeline send/receive                           (2·v messages)
          + the schedule's fixed cost per compute action    (2·v actions; plan.overheads)
    T     = m·t_mb + bubble,  bubble = (p - 1)/v · t_mb     ((p-1)/(m+p-1) of m·t_mb + bubble)
          + exposed data-parallel / ZeRO traffic
          + optimizer step + gradient copies and accumulation

Data-parallel gradient traffic overlaps the backward of the last micro-batch
(:mod:`plait.plan.dp_comm`). Every
compute window is scaled by the hardware's ``comm_overlap`` (1 on GPUs; 0 for CPU ranks
of one core each, where the transport's threads compete with compute for the core).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from plait.plan.activation_offload import exposed_copy_seconds
from plait.plan.activations import kv_heads_local, layer_activation_bytes
from plait.plan.compute import (
    attention_flops,
    block_time,
    edge_time,
    hardware_flops_per_token,
)
from plait.plan.dp_comm import dp_comm_time
from plait.plan.hardware import Hardware
from plait.plan.layout import Layout, Precision, Runtime
from plait.plan.memory import (
    MemoryBreakdown,
    copies_gradients,
    memory_per_rank,
    stage_params,
    stage_shape,
)
from plait.plan.modelspec import ModelSpec
from plait.plan.moe import MoESpec
from plait.plan.network import (
    all_to_all_time,
    group,
    p2p_time,
)
from plait.plan.offload_time import offload_step_time
from plait.plan.optimizer_time import extra_seconds
from plait.plan.overheads import (
    attention_length,
    in_step_time,
    pipeline_action_seconds,
    pipeline_loss_seconds,
    ring_block_seconds,
    zero3_unit_numels,
    zero3_unit_seconds,
)
from plait.plan.query import Query
from plait.plan.tp_comm import activation_message_bytes, tp_comm_time
from plait.plan.units import shard_numel, stage_units


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on the slowest rank, by component (they add up)."""

    compute: float
    """Forward and backward of every micro-batch (no recomputation)."""
    recompute: float
    """Forward work repeated by activation recomputation."""
    tp_comm: float
    """Tensor-parallel all-reduces (or all-gather + reduce-scatter), on the critical path."""
    cp_comm: float
    """Context-parallel traffic not hidden (ring: under attention; Ulysses: all of it)."""
    pp_comm: float
    """Pipeline point-to-point sends between stages and the schedule's fixed cost per
    compute action (:func:`plait.plan.overheads.pipeline_action_seconds`)."""
    bubble: float
    """Pipeline fill and drain."""
    dp_comm: float
    """Exposed data-parallel / ZeRO traffic."""
    optimizer: float
    """The optimizer step and gradient clipping."""
    other: float
    """Gradient bucket copies, accumulation, per-step scalar collectives, activation
    offload's copies that the compute does not hide."""
    dp_comm_total: float
    """Data-parallel / ZeRO traffic before overlap (for reference; not in ``total``)."""
    ep_comm: float = 0.0
    """Expert-parallel all-to-alls of a mixture-of-experts model (dispatch and combine,
    forward and backward; :mod:`plait.plan.moe_estimate`), on the critical path."""

    @property
    def total(self) -> float:
        """The step time."""
        return (
            self.compute
            + self.recompute
            + self.tp_comm
            + self.cp_comm
            + self.pp_comm
            + self.bubble
            + self.dp_comm
            + self.optimizer
            + self.other
            + self.ep_comm
        )

    def as_dict(self) -> dict[str, float]:
        """Plain numbers, with ``total``."""
        d = {k: float(v) for k, v in asdict(self).items()}
        d["total"] = self.total
        return d


@dataclass(frozen=True)
class Estimate:
    """The planner's prediction for one layout."""

    model: ModelSpec
    """The model."""
    layout: Layout
    """The layout."""
    hardware: Hardware
    """The device."""
    precision: Precision
    """The precision policy."""
    runtime: Runtime
    """The runtime traits."""
    seq_len: int
    """Tokens per sequence."""
    memory: MemoryBreakdown
    """Bytes on one rank of the worst stage."""
    time: StepTime
    """Step time by component."""
    usable_bytes: float
    """Device memory minus the headroom."""
    moe: MoESpec | None = None
    """The mixture-of-experts part of the model (None: dense); MFU counts its active
    parameters (:mod:`plait.plan.moe_estimate`)."""

    @property
    def query(self) -> Query:
        """The query of this one layout (its devices and global batch)."""
        headroom = 1 - self.usable_bytes / self.hardware.memory_bytes
        return Query.of_layout(
            self.model, self.layout, self.hardware, self.precision, self.runtime,
            self.seq_len, headroom, self.moe,
        )  # fmt: skip

    @property
    def fits(self) -> bool:
        """Whether the worst rank's memory fits the usable device memory."""
        return self.memory.total <= self.usable_bytes

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step."""
        return self.layout.global_batch * self.seq_len

    @property
    def tokens_per_s(self) -> float:
        """Training throughput of the whole job."""
        return self.tokens_per_step / self.time.total

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs per second over the devices' peak
        (Chowdhery et al. 2022, appendix B)."""
        per_tok = self.model.flops_per_token(self.seq_len)
        if self.moe is not None:
            per_tok += self.moe.flops_delta_per_token()
        return per_tok * self.tokens_per_s / (self.layout.world * self.hardware.peak_flops)

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: counts the recomputed FLOPs too."""
        per_tok = hardware_flops_per_token(self.model, self.seq_len, self.layout.recompute)
        if self.moe is not None:
            per_tok += self.moe.flops_delta_per_token() * (
                4 / 3 if self.layout.recompute == "full" else 1
            )
        return per_tok * self.tokens_per_s / (self.layout.world * self.hardware.peak_flops)

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready summary (schema: docs/planner.md, tests/cli/test_plan.py)."""
        return {
            "model": asdict(self.model) | {"params": self.model.param_count()},
            "hardware": self.hardware.name,
            "precision": self.precision.name,
            "runtime": self.runtime.name,
            "seq_len": self.seq_len,
            "layout": asdict(self.layout) | {"world": self.layout.world},
            "global_batch": self.layout.global_batch,
            "memory_bytes": self.memory.as_dict(),
            "usable_bytes": self.usable_bytes,
            "fits": self.fits,
            "time_s": self.time.as_dict(),
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "hfu": self.hfu,
        }


def cp_layer_time(q: Query, layout: Layout, msg: float) -> float:
    """Exposed context-parallel communication of one layer for one micro-batch (forward,
    backward and a full recomputation's second forward); ``msg`` is the bytes of the
    local hidden states b·(s/c)·h·e.

    * ring: K and V blocks travel the ring ``cp - 1`` steps per forward; backward moves
      K, V and their gradients (twice the bytes) over twice the work; each pass hides
      what ``hw.comm_overlap`` of the blocks' attention compute covers;
    * ulysses: four all-to-alls (Q, K, V to head shards, the output back) per forward
      and four per backward, not overlapped; KV heads fewer than cp (or not divisible by
      it) travel repeated to the query heads.
    """
    if layout.cp <= 1:
        return 0.0
    spec, hw, seq_len = q.model, q.hardware, q.seq_len
    cp_g = group(layout, hw, "cp")
    fwd_passes = 2 if layout.recompute == "full" else 1
    heads = spec.n_heads // layout.tp if spec.n_heads % layout.tp == 0 else spec.n_heads
    kv = kv_heads_local(spec, layout.tp)
    per_head = msg / spec.hidden * spec.head_dim  # bytes of one head's local Q
    if layout.cp_attention == "ulysses":
        kv = kv if kv % layout.cp == 0 else heads
        a2a = 2 * all_to_all_time(per_head * heads, cp_g.size, cp_g.link) + 2 * all_to_all_time(
            per_head * kv, cp_g.size, cp_g.link
        )
        return (fwd_passes + 1) * a2a
    # each exchange is synchronous in the step: its in-step cost (plan.overheads)
    ring_f = (layout.cp - 1) * in_step_time("p2p", 2 * per_head * kv, 2, cp_g.link)
    attn_f = attention_flops(spec, layout, seq_len) / hw.attention.at(
        attention_length(layout, seq_len)
    )
    return (fwd_passes + 2) * max(0.0, ring_f - hw.comm_overlap * attn_f)


def step_time(q: Query, layout: Layout) -> StepTime:
    """Predicted step time of ``layout`` by component."""
    spec, hw, precision, runtime = q.model, q.hardware, q.precision, q.runtime
    p, m, v = layout.pp, layout.microbatches, layout.chunks
    blk = block_time(q, layout)
    edge = edge_time(q, layout)
    msg = activation_message_bytes(q, layout)
    tp_g = group(layout, hw, "tp")
    tpc = tp_comm_time(q, layout)  # synchronous: in-step costs
    block_tp, edge_tp, tp_loss, gain = tpc.block, tpc.edge, tpc.loss, tpc.gain

    cp_exposed = cp_layer_time(q, layout, msg)
    ring_fwd, ring_bwd = ring_block_seconds(q, layout)

    pp_g = group(layout, hw, "pp")
    p2p = 2 * v * p2p_time(msg / (layout.tp if layout.sequence_parallel else 1), pp_g.link)

    worst: tuple[float, float, float, float, float, float, float, float] | None = None
    worst_stage = 0
    # the first stage has the embedding, the last the head; with edge_trim the second
    # (a middle stage) has the most blocks
    for stage in sorted({0, p - 1} | ({1} if layout.edge_trim and p > 2 else set())):
        sp = stage_params(spec, layout, stage)
        comp_f = sp.layers * (blk.forward + ring_fwd)
        comp_b = sp.layers * (blk.backward + ring_bwd)
        rc = sp.layers * (blk.recompute + (ring_fwd if layout.recompute == "full" else 0.0))
        tp = sp.layers * block_tp
        if stage == 0:
            comp_f += edge.embed_forward
            comp_b += edge.embed_backward
            tp += edge_tp  # vocabulary-parallel embedding output all-reduce
        if stage == p - 1:
            comp_f += edge.head_forward
            comp_b += edge.head_backward
            tp += edge_tp  # gradient of the head's (replicated) input
            tp += tp_loss  # vocabulary-parallel cross-entropy
            if layout.sequence_parallel and layout.tp > 1:
                tp += gain  # the final norm's gain
        cp = sp.layers * cp_exposed
        # activation offload: the copies the stage's compute does not hide
        per_layer = layer_activation_bytes(q, layout)
        copy = exposed_copy_seconds(per_layer, sp.layers, layout, hw, comp_f + comp_b + rc)
        # the schedule's cost per action, and per second of this stage's work
        pp = p2p + pipeline_action_seconds(layout, hw, comp_f + comp_b + rc) if p > 1 else 0.0
        total = comp_f + comp_b + rc + tp + cp + pp + copy
        if worst is None or total > worst[0]:
            worst, worst_stage = (total, comp_f, comp_b, rc, tp, cp, pp, copy), stage
    assert worst is not None
    t_mb, comp_f, comp_b, rc, tp, cp, pp, copy = worst
    bubble = (p - 1) / (v if layout.schedule == "interleaved" else 1) * t_mb if p > 1 else 0.0

    sp0 = stage_params(spec, layout, worst_stage)
    dp_exposed, dp_total = dp_comm_time(q, layout, sp0.params, comp_f, comp_b + rc)
    f = layout.shard_factor
    opt_params = math.ceil(sp0.params / f) if layout.zero >= 1 else sp0.params
    fp32_copy = 4 if precision.master_bytes else precision.param_bytes
    traffic = (
        2 * fp32_copy
        + 4 * precision.grad_bytes  # read for the update; clip: read for the norm, scale
        + 2 * precision.optimizer_bytes
        + (precision.param_bytes if precision.master_bytes else 0)
    )
    optimizer = opt_params * traffic / hw.optimizer_bandwidth
    if layout.offload != "none":  # the host step; every stage's, after the schedule (pp)
        times = []
        for s in sorted({0, worst_stage, p - 1}):
            held = stage_units(spec, layout.tp, p, s, layout.edge_trim)
            shards = [shard_numel(u, f) for u in held]  # slot order, as the runtime steps
            step_s = m * (comp_f + comp_b + rc)  # the device work a delayed update hides under
            times.append(offload_step_time(shards, layout, hw, precision, comp_b + rc, step_s))
        optimizer = max(times)
    # Muon's Newton-Schulz and exchanges, Adafactor's all-reduces (0 for AdamW)
    shape = stage_shape(spec, layout, worst_stage)
    optimizer += extra_seconds(spec, q.optimizer, layout, hw, shape)
    grads = sp0.params * precision.grad_bytes
    other = 0.0 if runtime.fused_accumulation else (m - 1) * 3 * grads / hw.elementwise.at(grads)
    other += m * copy  # activation offload's exposed copies
    if copies_gradients(layout, precision, runtime):
        other += 4 * grads / hw.elementwise.at(grads) + 2 * sp0.tensors * hw.op_overhead_s
    if layout.zero == 3 and layout.pp == 1 and layout.shard_factor > 1:
        numels = zero3_unit_numels(spec, layout, sp0.params)
        other += m * zero3_unit_seconds(
            [n * precision.param_bytes for n in numels], sp0.tensors, hw
        )
    dpcp = group(layout, hw, "dp+cp")
    # scalar all-reduces (loss, gradient norm), synchronous in the step
    other += runtime.step_collectives * in_step_time("all_reduce", 8, dpcp.size, dpcp.link)
    other += in_step_time("all_reduce", 8, tp_g.size, tp_g.link)  # norm over tp shards
    other += pipeline_loss_seconds(layout, pp_g.link)  # the loss to every stage
    return StepTime(
        compute=m * (comp_f + comp_b),
        recompute=m * rc,
        tp_comm=m * tp,
        cp_comm=m * cp,
        pp_comm=m * pp,
        bubble=bubble,
        dp_comm=dp_exposed,
        optimizer=optimizer,
        other=other,
        dp_comm_total=dp_total,
    )


def estimate(q: Query, layout: Layout) -> Estimate:
    """Memory and time of ``layout`` for the dense model of ``q`` (``q.headroom``: the
    fraction of device memory kept free, for allocator fragmentation and framework
    buffers; the MoE model's: :func:`plait.plan.evaluate.layout_estimate`)."""
    mem = memory_per_rank(q, layout)
    t = step_time(q, layout)
    usable = q.hardware.memory_bytes * (1 - q.headroom)
    return Estimate(q.model, layout, q.hardware, q.precision, q.runtime, q.seq_len, mem, t, usable)
