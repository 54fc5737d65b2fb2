"""Per-rank memory: training state, activations in flight, temporary buffers.

**State** (Rajbhandari et al. 2020, "ZeRO", section 5.1): a rank holding P parameters
(its tensor/pipeline share) with p, g, m, o bytes per parameter of weights, gradients,
fp32 master weights and optimizer state, sharded over F data-parallel ranks::

    stage 0   P·(p + g + m + o)                   mixed Adam: 16 bytes/param
    stage 1   P·(p + g) + P·(m + o)/F             4 + 12/F
    stage 2   P·p + P·(g + m + o)/F               2 + 14/F
    stage 3   P·(p + g + m + o)/F                 16/F

Shards are ``ceil(P/F)`` in the textbook count (:func:`state_bytes`); the per-rank
model counts what the runtime allocates: each ZeRO unit padded to a multiple of F,
per-piece optimizer scalars (:mod:`plait.plan.units`). Tensor parallelism
splits every linear layer's weight (and column-parallel biases) by t; norms and
row-parallel biases are replicated. Pipeline stage j holds its layers, the first stage
the embedding, the last the final norm and head (a tied head is a second copy when
pp > 1, as in Megatron-LM).

**LoRA** (``q.lora``): the base is frozen, held (its tensor/pipeline share) in the
compute dtype with no gradient, master or optimizer state; the adapters are the trained
parameters above, one ZeRO unit per block (:func:`lora_stage`).

**Activations**: :mod:`plait.plan.activations` per layer and micro-batch, times the
micro-batches a stage holds at its peak: GPipe m; 1F1B ``min(m, p - j)`` on stage j
(Narayanan et al. 2021, section 2.2); interleaved 1F1B ``((v-1)·p + 2·(p-j-1) + 1)/v``
micro-batch equivalents (Megatron-LM's warm-up count; on the first stage
``p + (p-1)/v``, i.e. Korthikanti et al.'s factor ``1 + (p-1)/(p·v)``), at most m.

With ``train.activation_offload`` the offloaded blocks' saved activations are on the
host instead (:attr:`MemoryBreakdown.host_activations`) and backward's two offloaded
blocks back on the device count as a buffer (:mod:`plait.plan.activation_offload`).

**Buffers**: data-parallel gradient buckets when they copy the gradients (a runtime
with ``grad_buckets="copy"``; plait's gradients are views into its buckets, which then
cost nothing beyond the gradients), the ZeRO-1 reduce-scatter bucket, ZeRO-2's
reduce-scatter buffers kept across steps (``min(K·(B + U·g), P·g)``: K =
:data:`ZERO2_KEPT_BUCKETS` buffers of the largest bucket, which closes once it holds B
bytes, so at most B plus one unit of U parameters; each bucket's own, i.e. the
gradients, when they fit in K), ZeRO-3's
gathered units (the computing unit plus the prefetched ones) and unsharded gradient
buffers (the unit collecting its gradients plus the two whose reduce-scatters are in
flight; their outputs are added into the gradient shards as they arrive), pipeline
send/receive buffers. Under pp, ZeRO-2/3 hold the unsharded
gradients of a step's micro-batches and (stage 3) the gathered pieces instead, per
``pp_grad_reduce`` and ``pp_reshard`` (:func:`pipeline_zero_buffer_bytes`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

from plait.plan.activation_offload import split_activations
from plait.plan.activations import (
    embedding_activation_bytes,
    head_activation_bytes,
    kv_heads_local,
    layer_activation_bytes,
)
from plait.plan.layout import Layout, Precision, Runtime
from plait.plan.lora import LoraSpec
from plait.plan.modelspec import ModelSpec
from plait.plan.offload import device_state
from plait.plan.optimizer import StageShape
from plait.plan.optimizer import state_bytes as optimizer_state_bytes
from plait.plan.query import Query
from plait.plan.units import Unit, lora_unit, stage_layers, stage_units, zero_state_bytes

ZERO2_KEPT_BUCKETS = 3
"""ZeRO-2's reduce-scatter buffers kept across steps, and ZeRO-3's transient full-gradient
buffers at their peak: the runtime's ``GradientReducer.MAX_REDUCES_IN_FLIGHT + 1`` (two
in flight, one collecting; a test keeps the two equal: the planner imports no torch)."""


def layer_params_per_rank(spec: ModelSpec, tp: int) -> int:
    """Parameters of one block on one tensor-parallel rank."""
    h, f, d = spec.hidden, spec.ffn_hidden, spec.head_dim
    q_local = spec.n_heads // tp * d
    kv_local = kv_heads_local(spec, tp) * d
    n = 2 * h * q_local + 2 * h * kv_local + spec.mlp_mats * h * (f // tp)
    if spec.bias:
        n += q_local + 2 * kv_local + (f // tp)  # column-parallel biases, split
        n += 2 * h  # row-parallel biases (o, fc2), replicated
        n += 4 * h  # LayerNorm gains and biases
    else:
        n += 2 * h
    return n


@dataclass(frozen=True)
class StageParams:
    """What one rank of a pipeline stage holds before ZeRO sharding."""

    params: int
    """Parameters (its tensor-parallel share)."""
    tensors: int
    """Parameter tensors."""
    layers: int
    """Transformer blocks."""
    unit_params: int
    """Parameters of the largest ZeRO-3 unit (one block, or the embedding/head)."""


def stage_params(spec: ModelSpec, layout: Layout, stage: int) -> StageParams:
    """Parameters one tensor-parallel rank of pipeline stage ``stage`` holds."""
    return _stage_params(spec, layout.tp, layout.pp, stage, layout.edge_trim)


@functools.lru_cache(maxsize=4096)
def _stage_params(spec: ModelSpec, t: int, p: int, stage: int, trim: int = 0) -> StageParams:
    layers = stage_layers(spec.n_layers, p, stage, trim)
    per_layer = layer_params_per_rank(spec, t)
    n = layers * per_layer
    tensors = layers * spec.layer_tensors()
    unit = per_layer if layers else 0
    vocab_local = math.ceil(spec.vocab / t) * spec.hidden
    if stage == 0:
        emb = vocab_local + (spec.max_positions * spec.hidden if spec.style == "gpt" else 0)
        n += emb
        tensors += 2 if spec.style == "gpt" else 1
        unit = max(unit, emb)
    if stage == p - 1:
        n += spec.final_norm_params()
        tensors += 2 if spec.bias else 1
        if not spec.tie_embeddings or p > 1:
            n += vocab_local
            tensors += 1
            unit = max(unit, vocab_local)
    return StageParams(n, tensors, layers, unit)


def stage_shape(spec: ModelSpec, layout: Layout, stage: int) -> StageShape:
    """:class:`StageShape` of one rank of ``stage`` (what the optimizer's terms need)."""
    sp = stage_params(spec, layout, stage)
    last = stage == layout.pp - 1
    head = last and (not spec.tie_embeddings or layout.pp > 1)
    return StageShape(sp.layers, sp.params, sp.tensors, stage == 0, head)


def in_flight(layout: Layout, stage: int) -> float:
    """Micro-batches (in units of the stage's whole layer set) alive at the stage's peak."""
    p, m, v = layout.pp, layout.microbatches, layout.chunks
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "1f1b":
        return float(min(m, p - stage))
    return min(float(m), ((v - 1) * p + 2 * (p - stage - 1) + 1) / v)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one rank of the worst pipeline stage."""

    stage: int
    """The pipeline stage this breakdown is for (the one with the largest total)."""
    params: float
    """Weights."""
    grads: float
    """Gradients."""
    master: float
    """fp32 master weights."""
    optimizer: float
    """Optimizer state (Adam m and v) and per-tensor scalars."""
    activations: float
    """Saved block activations of every micro-batch in flight."""
    embedding_head: float
    """Saved activations of the embedding, final norm, head and loss."""
    buffers: float
    """Gradient buckets, ZeRO gathered units, pipeline send/receive buffers."""
    in_flight: float
    """Micro-batches in flight on this stage."""
    layer_activation: float
    """Bytes one block saves for one micro-batch."""
    host_activations: float = 0.0
    """Saved activations offloaded to host memory (``train.activation_offload``; not in
    :attr:`total`, which is the device's)."""

    @property
    def state(self) -> float:
        """Weights + gradients + master + optimizer state."""
        return self.params + self.grads + self.master + self.optimizer

    @property
    def total(self) -> float:
        """Everything."""
        return self.state + self.activations + self.embedding_head + self.buffers

    def as_dict(self) -> dict[str, float]:
        """Plain numbers, with ``state`` and ``total``."""
        d: dict[str, float] = {k: float(v) for k, v in asdict(self).items()}
        d["state"] = self.state
        d["total"] = self.total
        return d


def state_bytes(
    params: int, tensors: int, layout: Layout, precision: Precision
) -> tuple[float, float, float, float]:
    """``(weights, gradients, master, optimizer)`` bytes for ``params`` parameters."""
    pr = precision
    f = layout.shard_factor
    shard = math.ceil(params / f)
    z = layout.zero
    weights = (shard if z >= 3 else params) * pr.param_bytes
    grads = (shard if z >= 2 else params) * pr.grad_bytes
    master = (shard if z >= 1 else params) * pr.master_bytes
    opt_tensors = 1 if z >= 1 else tensors  # sharded optimizers hold one flat shard
    optimizer = (shard if z >= 1 else params) * pr.optimizer_bytes + (
        opt_tensors * pr.optimizer_tensor_bytes
    )
    return float(weights), float(grads), float(master), float(optimizer)


def copies_gradients(layout: Layout, precision: Precision, runtime: Runtime) -> bool:
    """Whether plain data parallelism keeps bucket copies of the gradients: only a
    runtime with ``grad_buckets="copy"`` (fp32 weights; with 16-bit weights plait wraps
    ZeRO stage 0, whose gradients are views into flat buffers). plait's DataParallel
    keeps ``.grad`` as views into its buckets: per-rank gradient bytes equal the
    parameter bytes."""
    return layout.zero == 0 and runtime.grad_buckets == "copy" and precision.master_bytes == 0


def buffer_bytes(q: Query, layout: Layout, sp: StageParams) -> float:
    """Temporary and persistent buffers of one rank holding ``sp``."""
    spec, precision, runtime, seq_len = q.model, q.precision, q.runtime, q.seq_len
    grad_bytes = sp.params * precision.grad_bytes
    bucket = runtime.bucket_mb * 2**20
    out = 0.0
    if copies_gradients(layout, precision, runtime):
        out += grad_bytes  # a runtime whose buckets copy every gradient
    elif layout.zero >= 2 and layout.pp > 1:
        pass  # the pipeline drives ZeRO-2/3: pipeline_zero_buffer_bytes
    elif layout.zero == 1:
        out += min(bucket, grad_bytes)  # one reduce-scatter bucket in flight
    elif layout.zero == 2:  # the reduce-scatter buffers kept across steps (BufferRing)
        largest = bucket + sp.unit_params * precision.grad_bytes  # a bucket closes past B
        out += min(ZERO2_KEPT_BUCKETS * largest, grad_bytes)
    elif layout.zero == 3:  # gathered units; gradient buffers (two in flight, one collecting)
        units = 1 + runtime.prefetch_units
        out += sp.unit_params * (
            units * precision.param_bytes + ZERO2_KEPT_BUCKETS * precision.grad_bytes
        )
    if layout.pp > 1:  # one activation and one gradient message buffered per direction
        msg = layout.micro_batch * seq_len / layout.cp * spec.hidden * precision.activation_bytes
        out += 2 * msg / (layout.tp if layout.sequence_parallel else 1)
    return out


def pipeline_zero_buffer_bytes(
    sp: StageParams, spec: ModelSpec, layout: Layout, precision: Precision, stage: int
) -> float:
    """ZeRO-2/3 under pipeline parallelism (:mod:`plait.parallel.pipeline.zero`): the
    unsharded gradients accumulated over a step's micro-batches, the gathered parameters
    (stage 3) and the reduce-scatter buffers in flight, at their peak on stage ``stage``.

    ``pp_grad_reduce = "step"`` holds the full gradients of every local piece (``P``)
    until the piece's last backward; ``"microbatch"`` one piece's (its blocks, ``1/v`` of
    the stage's, plus the embedding or head it holds: a tied matrix, reduced at the end
    of the step, is counted with every piece). Stage 3 holds every local
    piece's parameters gathered through the step (``P``), or one piece's with
    ``pp_reshard``. Two units' reduce-scatter buffers are in flight at most.
    """
    if layout.zero < 2 or layout.pp == 1:
        return 0.0
    layer = layer_params_per_rank(spec, layout.tp)
    edge = sp.params - sp.layers * layer  # embedding / final norm and head, if any
    piece = math.ceil(sp.layers / layout.chunks) * layer + edge  # the largest local piece
    held = sp.params if layout.pp_grad_reduce == "step" else piece
    out = (held + 2 * sp.unit_params) * precision.grad_bytes
    if layout.zero == 3:
        out += (piece if layout.pp_reshard else sp.params) * precision.param_bytes
    return float(out)


def stage_memory(q: Query, layout: Layout, stage: int, shard_rank: int = 0) -> MemoryBreakdown:
    """Bytes on one rank of pipeline stage ``stage``; under ZeRO, on rank ``shard_rank``
    of its shard group (rank 0 holds the most non-padding elements)."""
    spec, precision = q.model, q.precision
    sp = stage_params(spec, layout, stage)
    if q.lora is not None:  # the frozen base plus the trained adapters
        sp, units, frozen = lora_stage(q.lora, spec, layout, sp)
        weights, grads, master, optimizer = _trained_state(sp, units, layout, precision, shard_rank)
        weights += frozen * precision.param_bytes
        weights, master, optimizer = device_state(weights, master, optimizer, layout.offload)
    elif layout.zero >= 1:  # the runtime's padded flat units, exactly
        units = stage_units(spec, layout.tp, layout.pp, stage, layout.edge_trim)
        f = layout.shard_factor
        weights, grads, master, optimizer = zero_state_bytes(
            units, layout.zero, f, shard_rank % f, precision
        )
        # ZeRO-Offload: masters and optimizer state (and with params the shards) on the host
        weights, master, optimizer = device_state(weights, master, optimizer, layout.offload)
    else:
        weights, grads, master, optimizer = state_bytes(sp.params, sp.tensors, layout, precision)
    if q.lora is None:  # Muon's or Adafactor's state instead of AdamW's moments
        shape = stage_shape(spec, layout, stage)
        optimizer = optimizer_state_bytes(spec, q.optimizer, layout, shape, optimizer)
    flight = in_flight(layout, stage)
    per_layer = layer_activation_bytes(q, layout)
    split = split_activations(per_layer, sp.layers, flight, layout)  # offloaded: on the host
    acts = split.device
    edge = 0.0
    if stage == 0:
        edge += flight * embedding_activation_bytes(q, layout)
    if stage == layout.pp - 1:
        edge += in_flight(layout, stage) * head_activation_bytes(q, layout)
    buffers = buffer_bytes(q, layout, sp) + split.refetch
    buffers += pipeline_zero_buffer_bytes(sp, spec, layout, precision, stage)
    return MemoryBreakdown(
        stage, weights, grads, master, optimizer, acts, edge, buffers, flight, per_layer, split.host
    )


def lora_stage(
    lora: LoraSpec, spec: ModelSpec, layout: Layout, base: StageParams
) -> tuple[StageParams, tuple[Unit, ...], int]:
    """What one rank of a stage holding ``base`` trains under LoRA: its blocks' adapters
    (as :class:`StageParams`, and as ZeRO's units: one per block), and the frozen base
    parameters it also holds."""
    unit = lora_unit(spec, layout.tp, lora)
    units = (unit,) * base.layers
    n = sum(sum(u) for u in units)
    trained = StageParams(n, base.layers * len(unit), base.layers, sum(unit) if units else 0)
    return trained, units, base.params


def _trained_state(
    sp: StageParams, units: tuple[Unit, ...], layout: Layout, precision: Precision, rank: int
) -> tuple[float, float, float, float]:
    """The state bytes of LoRA's adapters: replicated (stage 0), or ZeRO's padded flat
    units (one per block) on rank ``rank`` of the shard group."""
    if layout.zero == 0:
        return state_bytes(sp.params, sp.tensors, layout, precision)
    f = layout.shard_factor
    return zero_state_bytes(units, layout.zero, f, rank % f, precision)


def memory_per_rank(q: Query, layout: Layout, shard_rank: int = 0) -> MemoryBreakdown:
    """The breakdown of the pipeline stage that needs the most memory (under ZeRO, for
    rank ``shard_rank`` of the shard group)."""
    # stage 0 has the most layers, micro-batches in flight and the embedding; the last
    # stage has the head: no other stage can need more
    candidates = {0, layout.pp - 1}
    if layout.edge_trim and layout.pp > 2:  # the second stage: more blocks, as many in flight
        candidates.add(1)
    best = None
    for j in sorted(candidates):
        m = stage_memory(q, layout, j, shard_rank)
        if best is None or m.total > best.total:
            best = m
    assert best is not None
    return best


def state_bytes_per_param(layout: Layout, precision: Precision) -> float:
    """Textbook bytes per parameter of the state for this ZeRO stage and F (no
    per-tensor scalars): e.g. 16, 4 + 12/F, 2 + 14/F, 16/F for mixed-precision Adam."""
    pr, f, z = precision, layout.shard_factor, layout.zero
    m_o = (pr.master_bytes + pr.optimizer_bytes) / (f if z >= 1 else 1)
    g = pr.grad_bytes / (f if z >= 2 else 1)
    w = pr.param_bytes / (f if z >= 3 else 1)
    return w + g + m_o


def max_params_replicated(memory_bytes: float, precision: Precision) -> float:
    """The largest model whose replicated state fits ``memory_bytes`` (no activations)."""
    return memory_bytes / precision.state_bytes_per_param
