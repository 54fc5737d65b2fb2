"""Step-time terms the roofline sum leaves out, each named and each measured on CPU ranks.

The compute model (:mod:`plait.plan.compute`) charges GEMMs, attention and memory-bound
layers; the traffic model (:mod:`plait.plan.network`) charges collectives as measured
between barriers. Real steps pay more, in places the measurements of
``benchmarks/planner_vs_measured.py`` point at:

* **in-step collectives** (:func:`in_step_time`): a collective issued synchronously
  between compute waits for the slower peer and for the transport's wake-ups. The
  profile measures this once, for an all-reduce on pairs of ranks
  (:func:`plait.bench.calibrate.measure_in_step`); another collective is charged the
  in-step cost of the all-reduce that moves the same bytes per rank, when that is more
  than its own time. Tensor parallelism already used it; now so do ZeRO-3's per-unit
  gathers and reduce-scatters, the ring's K/V and dK/dV exchanges and the per-step
  scalar all-reduces. Without an in-step measurement (GPU presets) nothing changes.
* **ring attention in chunks** (:func:`attention_length`): ring attention computes its
  queries against key blocks of ``s / (2·cp)`` tokens (two chunks per rank, zigzag), so
  its attention runs at the rate of that length, not of the whole sequence.
* **ring merges and copies** (:func:`ring_block_seconds`): per visible chunk pair the
  ring copies its operands contiguous, merges the partial output by log-sum-exp in
  forward, and accumulates dQ, dK, dV in backward: :data:`RING_FWD_PASSES` and
  :data:`RING_BWD_PASSES` passes over a chunk's ``(b, h, c, d)`` tensor and
  :data:`RING_FWD_OPS` / :data:`RING_BWD_OPS` operator calls, plus the profile's
  ``ring_overhead_s`` per layer (its Python calls, calibrated on a tiny ring).
* **ZeRO-3 unit copies and hooks** (:func:`zero3_unit_seconds`), per unit the runtime
  really has (:func:`zero3_unit_numels`: the embedding and the head are units of their
  own, and so is the root with the final norm: 7 for a 4-block model, not 5; each
  unit's gathers and reduce-scatter pay their in-step latency): every gather copies the
  gathered flat buffer into the unit's storage (before forward and again before
  backward), every backward flattens the unit's gradients for the reduce-scatter, and
  the hooks swap every parameter in and out.
* **pipeline actions and the loss broadcast** (:func:`pipeline_action_seconds`,
  :func:`pipeline_loss_seconds`): every compute action of a pipeline schedule (a
  piece's forward or backward of one micro-batch, ``2·v`` per micro-batch and rank)
  pays a fixed cost the rates do not see (the runtime's Python, the piece's module
  calls, one autograd backward call, receive buffers), the profile's
  ``pp_action_overhead_s`` (calibrated on a tiny two-stage pipeline by
  :func:`plait.bench.calibrate.measure_pipeline`); after the schedule the last stage
  broadcasts the mean loss to the other stages (one synchronous scalar collective over
  pp). Measured on the benchmark's pp2 row (4 micro-batches of 2): the pipeline
  runtime's compute actions cost about the same pieces run plainly plus this fixed
  cost, and the loss broadcast about 0.5 ms of CPU time per step.
* **block composition** (:func:`block_scale`): a block's operators run together cost
  more (or less) than each at its own calibrated rate: on the benchmark's block (hidden
  128, 1024 tokens, CPU, a quiet machine) the GEMMs ran about 10 % faster than the
  linear-layer rate and the memory-bound remainder (norms, rotary, SwiGLU, residuals,
  the gradient sums of tensors with several consumers, autograd's nodes) about 1.8x
  slower than the chain's rate, by amounts that vary with the shape and the moment.
  The profile's ``block_scale`` is the measured over charged time of a stack of
  plait's blocks on a grid of shapes, and the block's compute is charged that ratio,
  interpolated log-bilinearly in (hidden, tokens) and clamped at the grid's edges.
* **tensor-parallel blocks** (:func:`tp_block_ratio`): a block sharded over tp = 2
  measured whole, collectives included, on pairs of ranks all at once (the profile's
  ``tp_block_scale``, ``sp_block_scale`` with sequence parallelism), over the charge
  for its compute and its in-step collectives. Measured on this machine (2 cores): the
  sharded block's compute alone ran 3-16 % above its tp = 1 ratio (36 % at the smallest
  shape with sequence parallelism), and a collective's in-step cost grew with the work
  before it (0.6-1 ms after 0.3 ms of work, 2.7-3 ms after 8.5 ms) and fell with four
  ranks on the two cores (0.2-1 ms) while the same four-rank block measured 1.1-1.5x
  its charge. One ratio per shape, for compute and collectives together, replaces
  ``block_scale`` for such blocks: at the grid's points the block is charged what was
  measured.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from plait.plan.hardware import IN_STEP, TP_GRID_DEGREE, Hardware, Link
from plait.plan.layout import Layout
from plait.plan.modelspec import ModelSpec
from plait.plan.network import all_gather_time, all_reduce_time, p2p_time, reduce_scatter_time
from plait.plan.query import Query
from plait.plan.units import shard_numel, stage_units

RING_FWD_PASSES = 13
"""Forward passes over one chunk pair's ``(b, h, c, d)`` tensor: q, k, v chunks made
contiguous (3 x read + write) and the log-sum-exp merge ``w1·o1 + w2·o2`` (two scaled
copies, read + write each, and their sum, read 2 + write 1)."""
RING_BWD_PASSES = 19
"""Backward passes per chunk pair: dO, q, O, k, v made contiguous (5 x 2) and dQ, dK,
dV accumulated (3 x read 2 + write 1)."""
RING_FWD_OPS = 14
"""Operator calls per chunk pair in forward (3 copies, the kernel, 10 of the merge)."""
RING_BWD_OPS = 9
"""Operator calls per chunk pair in backward (5 copies, the kernel, 3 accumulations)."""
ZERO3_COPY_PASSES = 6
"""Passes over a unit's bytes per micro-batch under ZeRO-3: the gathered buffer copied
into the unit before forward and before backward (2 x read + write) and the gradients
flattened for the reduce-scatter (read + write)."""
ZERO3_UNIT_OPS = 4
"""Operator calls per unit and micro-batch besides the per-parameter swaps: two gathers'
copies, the gradient flatten and the shard accumulation."""


def equivalent_all_reduce_bytes(op: str, nbytes: float, n: int) -> float:
    """The all-reduce size that sends as many bytes per rank as ``op`` of ``nbytes``
    (ring algorithms): all-reduce ``2(n-1)/n·S``, all-gather and reduce-scatter
    ``(n-1)/n·S`` (S the full tensor), a point-to-point exchange ``S``."""
    if n <= 1:
        return 0.0
    per_rank = {
        "all_reduce": 2.0 * (n - 1) / n * nbytes,
        "all_gather": (n - 1) / n * nbytes,
        "reduce_scatter": (n - 1) / n * nbytes,
        "p2p": nbytes,
    }[op]
    return per_rank * n / (2.0 * (n - 1))


def in_step_time(op: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds a synchronous ``op`` of ``nbytes`` over ``n`` ranks adds inside a step: its
    own time, or the profile's in-step all-reduce of the same bytes per rank when that
    is more (it includes waiting for the peer)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if op == "all_gather":
        own = all_gather_time(nbytes, n, link)
    elif op == "reduce_scatter":
        own = reduce_scatter_time(nbytes, n, link)
    elif op == "p2p":
        own = p2p_time(nbytes, link)
    else:
        own = all_reduce_time(nbytes, n, link)
    seen = in_step_measured(link, n, equivalent_all_reduce_bytes(op, nbytes, n))
    return own if seen is None else max(own, seen)


def in_step_measured(link: Link, n: int, nbytes: float) -> float | None:
    """The profile's in-step all-reduce on ``n`` ranks at ``nbytes``; a message below the
    smallest measured one costs that one (latency-bound); None beyond the largest or
    without a measurement on groups of ``n``."""
    for name, size, curve in link.measured:
        if name == IN_STEP and size == n:
            lo = curve.points[0][0]
            return link.measured_seconds(IN_STEP, n, max(nbytes, lo))
    return None


def attention_length(layout: Layout, seq_len: int) -> float:
    """The key length attention kernels run at: ``s / (2·cp)`` for ring attention over
    cp > 1 ranks (two chunks per rank), else the sequence."""
    if layout.cp > 1 and layout.cp_attention == "ring":
        return seq_len / (2 * layout.cp)
    return float(seq_len)


def ring_pairs(cp: int) -> int:
    """Visible (query chunk, key chunk) pairs per rank per layer under causal zigzag ring
    attention: the ``2cp(2cp + 1)/2`` causal pairs of ``2cp`` chunks, evenly spread."""
    return 2 * cp + 1


def ring_block_seconds(q: Query, layout: Layout) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's ring merges, copies and calls for one
    micro-batch on one rank (0 without ring attention)."""
    if layout.cp <= 1 or layout.cp_attention != "ring":
        return 0.0, 0.0
    spec, precision, hw, seq_len = q.model, q.precision, q.hardware, q.seq_len
    heads = spec.n_heads / layout.tp
    c = seq_len / (2 * layout.cp)
    acc = max(4, precision.activation_bytes)  # merged in >= fp32
    chunk = layout.micro_batch * heads * c * spec.head_dim * acc
    rate = hw.elementwise.at(chunk)
    pairs = ring_pairs(layout.cp)
    fixed = hw.ring_overhead_s / 3  # the calibrated per-layer calls, a third in forward
    fwd = pairs * (RING_FWD_PASSES * chunk / rate + RING_FWD_OPS * hw.op_overhead_s) + fixed
    bwd = pairs * (RING_BWD_PASSES * chunk / rate + RING_BWD_OPS * hw.op_overhead_s) + 2 * fixed
    return fwd, bwd


def zero3_unit_seconds(unit_bytes: Sequence[float], tensors: int, hw: Hardware) -> float:
    """Seconds of ZeRO-3's copies and hooks per micro-batch on one rank: units of
    ``unit_bytes`` each (weights; gradients the same size) holding ``tensors`` parameter
    tensors in all (each swapped in and out at each of the two gathers and the free)."""
    if not unit_bytes:
        return 0.0
    rate = hw.elementwise.at
    copies = sum(ZERO3_COPY_PASSES * b / rate(max(b, 1.0)) for b in unit_bytes)
    calls = (len(unit_bytes) * ZERO3_UNIT_OPS + 3 * tensors) * hw.op_overhead_s
    return copies + calls


def zero3_unit_numels(spec: ModelSpec, layout: Layout, params: float) -> list[float]:
    """Gathered elements of each ZeRO-3 unit of a one-stage model on one tensor-parallel
    rank, as the runtime wraps it (:func:`plait.plan.units.stage_units`: the embedding,
    each block, the head, the root with the final norm), each padded to a multiple of
    the shard factor, scaled so that they hold ``params`` parameters (the stage's)."""
    units = stage_units(spec, layout.tp, 1, 0, layout.edge_trim)
    f = layout.shard_factor
    held = sum(sum(u) for u in units)
    scale = params / held if held else 1.0
    return [scale * shard_numel(u, f) * f for u in units]


def pipeline_action_seconds(layout: Layout, hw: Hardware, work_s: float = 0.0) -> float:
    """Seconds of the pipeline schedule's extra cost for one micro-batch on one rank:
    ``2·v`` compute actions (forward and backward of each of its ``v`` pieces) x the
    profile's ``pp_action_overhead_s``, plus ``pp_action_per_work`` x ``work_s``, the
    rank's compute for that micro-batch (0 without pipeline parallelism)."""
    if layout.pp <= 1:
        return 0.0
    return 2 * layout.chunks * hw.pp_action_overhead_s + hw.pp_action_per_work * work_s


def pipeline_loss_seconds(layout: Layout, link: Link) -> float:
    """Seconds of the per-step broadcast of the last stage's mean loss (one float64) to
    the other pipeline stages, synchronous in the step (0 without pipeline parallelism).

    A :class:`~plait.plan.hardware.Link` carries no broadcast cost (neither a fit nor a
    measurement), so an all-reduce of the same 8 bytes over the pp ranks stands in for
    it: both are one latency-bound scalar collective, and the profile's in-step
    all-reduce measurement (:func:`in_step_time`) is what prices it on a calibrated
    profile."""
    if layout.pp <= 1:
        return 0.0
    return in_step_time("all_reduce", 8, layout.pp, link)


def _bracket(values: list[float], x: float) -> tuple[int, int, float]:
    """Indices ``(i, j)`` of the grid values around ``x`` (clamped) and the weight of
    ``j`` in log space."""
    if x <= values[0] or len(values) == 1:
        return 0, 0, 0.0
    if x >= values[-1]:
        return len(values) - 1, len(values) - 1, 0.0
    j = bisect.bisect_right(values, x)
    i = j - 1
    w = (math.log(x) - math.log(values[i])) / (math.log(values[j]) - math.log(values[i]))
    return i, j, w


def grid_ratio(grid: Sequence[tuple[float, float, float]], hidden: float, tokens: float) -> float:
    """A ``(hidden, tokens, ratio)`` grid's ratio at ``hidden`` and ``tokens``:
    log-bilinear between its points, clamped at its edges; 1 for an empty grid."""
    if not grid:
        return 1.0
    table = {(d, t): r for d, t, r in grid}
    dims = sorted({d for d, _ in table})
    toks = sorted({t for _, t in table})
    i0, i1, wd = _bracket(dims, hidden)
    j0, j1, wt = _bracket(toks, tokens)
    log = math.log
    v = (
        (1 - wd) * (1 - wt) * log(table[dims[i0], toks[j0]])
        + (1 - wd) * wt * log(table[dims[i0], toks[j1]])
        + wd * (1 - wt) * log(table[dims[i1], toks[j0]])
        + wd * wt * log(table[dims[i1], toks[j1]])
    )
    return math.exp(v)


def block_scale(hw: Hardware, hidden: float, tokens: float) -> float:
    """The profile's measured / charged ratio of a block's forward + backward at
    ``hidden`` and ``tokens`` (per micro-batch and rank): log-bilinear between the
    grid's points of :attr:`Hardware.block_scale`, clamped at its edges; 1 without."""
    return grid_ratio(hw.block_scale, hidden, tokens)


def tp_block_ratio(hw: Hardware, layout: Layout, hidden: float, tokens: float) -> float | None:
    """The tensor-parallel block grid's ratio (:attr:`Hardware.tp_block_scale`, or
    :attr:`~Hardware.sp_block_scale` under sequence parallelism) at ``hidden`` and
    ``tokens`` per micro-batch and rank, when it applies: the layout's tp is the degree
    the grid was measured at (:data:`~plait.plan.hardware.TP_GRID_DEGREE`) and the
    profile has the grid. None otherwise (the block is charged ``block_scale`` and its
    collectives their in-step cost, as before)."""
    if layout.tp != TP_GRID_DEGREE:
        return None
    grid = hw.sp_block_scale if layout.sequence_parallel else hw.tp_block_scale
    return grid_ratio(grid, hidden, tokens) if grid else None
