"""Measure this machine: compute rates and alpha-beta fits of the collectives.

:func:`calibrate` starts ``nproc`` ranks (a :class:`plait.testing.WorkerPool`, gloo on
CPU), and on every rank at once, so that the ranks compete for the machine as they do
in training, measures

* dense fp32 square matmul FLOP/s at several sizes (its best point is the peak used for
  MFU), and the FLOP/s of a linear layer in training, forward and both gradients, at
  several sizes (the ``matmul`` curve the planner charges GEMMs at);
* fused attention forward + backward FLOP/s at several sequence lengths (causal, the
  FLOP convention of :mod:`plait.plan.compute`);
* memory-bound bytes/s of a block's norm, rotary, activation and residual layers in
  training, charged as the planner charges them (the ``elementwise`` curve), and the
  fixed cost of one operator call;
* the AdamW step plus gradient clipping, as bytes/s of the traffic the planner charges
  for it;
* all-reduce, all-gather, reduce-scatter and point-to-point times over message sizes
  (the mean over repetitions: a step pays the long tail too), fitted to
  ``t = c_alpha·alpha + bytes/B`` by least squares on relative error, with the
  algorithm's step count ``c_alpha`` and bytes per rank (ring: ``2(N-1)`` and
  ``2(N-1)/N·S`` for all-reduce; ``N-1`` and ``(N-1)/N·S`` for all-gather and
  reduce-scatter; 1 and S for a message);
* the cost one all-reduce adds *inside a step* (:func:`measure_in_step`: on pairs of
  ranks, interleaved with a linear layer's training work, synchronous, no barrier), the
  ``all_reduce_in_step`` curve the planner charges tensor-parallel collectives at;
* the fixed cost of a pipeline schedule's compute action, on a tiny two-stage pipeline
  (:mod:`plait.bench.calibrate_pipeline`);
* a stack of plait's blocks in training on a grid of shapes, kept as the ratio of its
  time to the planner's charge (``block_scale``,
  :func:`plait.bench.compute_profile.block_scale_points`), and the same blocks sharded
  over the tp pairs, collectives included (``tp_block_scale``, ``sp_block_scale``,
  :mod:`plait.bench.tp_block`).

The compute measurements live in :mod:`plait.bench.measure` (medians, two clocks) and
become profile fields in :mod:`plait.bench.compute_profile`; a
collective's time is the slowest rank's, and the profile keeps both the fit and the
measured points (interpolated for groups of the measured size). The result is a
:class:`Hardware` profile that :func:`plait.plan.profile_toml.dump_hardware` writes and
``plait plan --hardware`` reads. This module and :mod:`plait.bench.measure` are the only
parts of :mod:`plait.plan` that need torch or processes; they import them inside their
functions.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from plait.bench.calibrate_pipeline import measure_pipeline, pipeline_overhead
from plait.bench.compute_profile import compute_fields, with_block_costs, with_compute
from plait.bench.measure import CLOCKS, compute_body
from plait.bench.tp_block import tp_block_body, with_tp_grids
from plait.plan.hardware import IN_STEP, Curve, Hardware, Link

__all__ = [
    "CLOCKS",
    "Fit",
    "calibrate",
    "calibrate_body",
    "compute_body",
    "fit_alpha_beta",
    "measure_in_step",
    "profile_from_results",
    "with_compute",
]

MESSAGE_BYTES = (2**10, 2**13, 2**16, 2**19, 2**22, 2**24)
IN_STEP_BYTES = (2**9, 2**16, 2**19, 2**21)
"""Message sizes of the in-step all-reduce measurement (tensor-parallel activations)."""
IN_STEP_PAIRS = 5
"""Alternating (with, without all-reduces) loop pairs per message size of the in-step
measurement; its cost is the median of the pairs' differences. Each pair sees about the
same background load, so a difference of paired loops varies less than a difference of
medians taken over the two kinds separately (three of each before: on a shared machine
the TP cost of one run moved by up to 3x between neighbouring layouts)."""
IN_STEP_WORK = (1024, 128, 256)
"""``(M, K, N)`` of the linear layer (forward + both gradients, ~2 ms on one x86 core) run
between two in-step all-reduces: about the work a tensor-parallel rank of the validated
``small`` model does between two of its all-reduces (a quarter of a block's forward +
backward). The in-step cost grows with that work (measured at 512 KiB on 2 loaded cores:
0.6-1.0 ms CPU with 0.3 ms of work between, 1.4-1.6 ms with 1.3 ms), so a profile
measured with this chunk fits models of that scale."""


@dataclass(frozen=True)
class Fit:
    """A least-squares alpha-beta fit of one collective."""

    op: str
    """Collective name."""
    alpha: float
    """Seconds per algorithm step."""
    bandwidth: float
    """Bytes per second."""
    points: tuple[tuple[float, float], ...]
    """``(message bytes, median seconds)`` measured."""


def fit_alpha_beta(
    points: Sequence[tuple[float, float]], steps: float, bytes_factor: float
) -> tuple[float, float]:
    """Fit ``t = steps·alpha + bytes_factor·S / B`` minimising relative error."""
    # weighted least squares of t = A + x·c with weights 1/t (relative residuals)
    rows = [(bytes_factor * s, t, 1.0 / t) for s, t in points]
    sw = sum(w * w for _, _, w in rows)
    sx = sum(w * w * x for x, _, w in rows)
    sy = sum(w * w * y for _, y, w in rows)
    sxx = sum(w * w * x * x for x, _, w in rows)
    sxy = sum(w * w * x * y for x, y, w in rows)
    det = sw * sxx - sx * sx
    c = (sw * sxy - sx * sy) / det if det else 0.0
    a = (sy - c * sx) / sw
    if c <= 0:  # latency-bound everywhere: attribute the largest message to bandwidth
        s_max, t_max = max(points)
        c = t_max / (bytes_factor * s_max)
        a = 0.0
    return max(a, 0.0) / max(steps, 1.0), 1.0 / c


def _collective_body(ctx: Any, sizes: Sequence[int], reps: int) -> dict[str, Any]:
    """On every rank: time each collective per message size (this rank's clocks; the
    profile takes the slowest rank). The result holds the wall-clock points, and under
    ``"cpu"`` the CPU-time points."""
    import torch

    from plait import comm

    mesh = ctx.mesh(dp=ctx.world_size)
    g = mesh.axis("dp")
    n = g.size
    ops_named = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
    out: dict[str, dict[str, list[Any]]] = {c: {op: [] for op in ops_named} for c in CLOCKS}
    for nbytes in sizes:
        elems = max(n, nbytes // 4 // n * n)
        t = torch.ones(elems)
        shard = torch.ones(elems // n)

        def timed(fn: Callable[[], object]) -> dict[str, float]:
            samples: dict[str, list[float]] = {c: [] for c in CLOCKS}
            fn()
            for _ in range(reps):
                comm.barrier(g)
                start = {c: clock() for c, clock in CLOCKS.items()}
                fn()
                for c, clock in CLOCKS.items():
                    samples[c].append(max(clock() - start[c], 1e-9))
            # the mean, not the median: a step pays for every collective it makes, and
            # loopback collectives have a long tail (median 0.5 ms, mean 2 ms is common)
            return {c: statistics.fmean(v) for c, v in samples.items()}

        ops: dict[str, Callable[[], object]] = {
            "all_reduce": functools.partial(comm.all_reduce, t, g),
            "all_gather": functools.partial(comm.all_gather, shard, g),
            "reduce_scatter": functools.partial(comm.reduce_scatter, t, g),
        }
        for op, fn in ops.items():
            for c, sec in timed(fn).items():
                out[c][op].append((4.0 * elems, sec))
        if n >= 2:

            def ping(t: Any = t) -> None:  # 0 <-> 1 round trip; others idle
                if g.index == 0:
                    comm.send(t, g, 1)
                    comm.recv(t, g, 1)
                elif g.index == 1:
                    comm.recv(t, g, 0)
                    comm.send(t, g, 0)

            for c, sec in timed(ping).items():
                out[c]["p2p"].append((4.0 * elems, sec / 2))
    return {**out["wall"], "cpu": out["cpu"]}


def measure_in_step(g: Any, sizes: Sequence[int], reps: int) -> dict[str, list[Any]]:
    """Per clock, ``(message bytes, seconds)`` one all-reduce adds to a step when issued
    as tensor parallelism issues it (Megatron-LM's f/g operators, Shoeybi et al. 2019):
    synchronously, back to back with compute, no barrier before it. Each rank runs
    ``reps`` x (a linear layer of :data:`IN_STEP_WORK` in training, then an all-reduce
    of the message); the cost is that loop minus the same loop without the all-reduces,
    per all-reduce. Unlike the barrier-separated times of :func:`_collective_body` it
    includes waiting for the slower peer and gloo's polling and wake-ups while it waits,
    which is what a step pays."""
    import torch

    from plait import comm

    m, k, n = IN_STEP_WORK
    x = torch.randn(m, k, requires_grad=True)
    w = torch.randn(n, k, requires_grad=True)
    gy = torch.randn(m, n)

    def work() -> None:
        (x @ w.t()).backward(gy)

    def loop(t: Any | None) -> dict[str, float]:
        comm.barrier(g)
        start = {c: clock() for c, clock in CLOCKS.items()}
        for _ in range(reps):
            work()
            if t is not None:
                comm.all_reduce(t, g)
        return {c: clock() - start[c] for c, clock in CLOCKS.items()}

    out: dict[str, list[Any]] = {c: [] for c in CLOCKS}
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4))
        loop(t)  # warm-up
        # alternate, so that a change of background load hits both loops of a pair
        # alike, and take the median of the pairs' differences
        pairs = [(loop(t), loop(None)) for _ in range(IN_STEP_PAIRS)]
        for c in CLOCKS:
            extra = statistics.median(a[c] - b[c] for a, b in pairs)
            out[c].append((4.0 * t.numel(), max(extra, 1e-9) / reps))
    return out


TINY_RING = (1, 2, 4, 8)
"""``(batch, heads, local sequence, head dim)`` of the tiny ring attention whose training
step on pairs of ranks measures the ring's fixed per-layer cost (:func:`measure_ring`)."""


def measure_ring(g: Any, reps: int) -> dict[str, float]:
    """Seconds of one forward + backward of plait's ring attention over the pair ``g`` at
    the tiny shape :data:`TINY_RING`, per clock (the median of ``reps``; no barrier in
    between, as a step runs it)."""
    import torch

    from plait.parallel.context.ring_attention import RingAttention

    b, h, s, d = TINY_RING
    ring = RingAttention(g)
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))

    def step() -> None:
        ring(q, k, v).sum().backward()

    step()
    comm_barrier(g)
    samples: dict[str, list[float]] = {c: [] for c in CLOCKS}
    for _ in range(reps):
        start = {c: clock() for c, clock in CLOCKS.items()}
        step()
        for c, clock in CLOCKS.items():
            samples[c].append(clock() - start[c])
    return {c: statistics.median(v) for c, v in samples.items()}


def comm_barrier(g: Any) -> None:
    """A barrier on ``g`` (plait.comm, imported here)."""
    from plait import comm

    comm.barrier(g)


def ring_charge(hw: Hardware) -> float:
    """Seconds the planner charges the tiny ring of :data:`TINY_RING` on 2 ranks (forward
    + backward: attention at its chunk rate, merges and copies, in-step exchanges)."""
    from plait.plan.compute import attention_flops
    from plait.plan.estimate import cp_layer_time
    from plait.plan.layout import PRECISIONS, Layout, Runtime
    from plait.plan.modelspec import ModelSpec
    from plait.plan.overheads import attention_length, ring_block_seconds
    from plait.plan.query import Query

    b, h, s, d = TINY_RING
    seq = 2 * s
    spec = ModelSpec("tiny-ring", 1, h * d, h, h, 4 * h * d, 256, "llama", seq)
    lay = Layout(cp=2, micro_batch=b)
    hw = replace(hw, comm_overlap=0.0)
    attn = 3 * attention_flops(spec, lay, seq) / hw.attention.at(attention_length(lay, seq))
    q = Query.of_layout(spec, lay, hw, PRECISIONS["fp32"], Runtime(), seq)
    fwd, bwd = ring_block_seconds(q, lay)
    msg = b * seq / 2 * spec.hidden * 4
    return attn + fwd + bwd + cp_layer_time(q, lay, msg)


def ring_overhead(hw: Hardware, measured_s: float) -> float:
    """The ring's fixed per-layer cost: the tiny ring's measured seconds minus what ``hw``
    (without a ring overhead) charges for it, at least 0."""
    return max(0.0, measured_s - ring_charge(replace(hw, ring_overhead_s=0.0)))


def _in_step_body(ctx: Any, quick: bool) -> dict[str, Any]:
    """The in-step all-reduce on groups of two ranks (tensor-parallel pairs; all pairs
    at once), labelled with that group size; empty on one rank or an odd world."""
    w = ctx.world_size
    if w < 2 or w % 2:
        return {"cpu": {}}
    g = ctx.mesh(dp=w // 2, tp=2).axis("tp")
    sizes = (IN_STEP_BYTES[0], IN_STEP_BYTES[2]) if quick else IN_STEP_BYTES
    res = measure_in_step(g, sizes, 10 if quick else 20)
    ring = measure_ring(g, 5 if quick else 15)
    pipe = measure_pipeline(ctx.mesh(dp=w // 2, pp=2), 5 if quick else 15, work=not quick)
    grids = tp_block_body(ctx.mesh(dp=w // 2, tp=2), quick)
    return {
        IN_STEP: res["wall"],
        "cpu": {IN_STEP: res["cpu"]},
        "ring": ring,
        "pipeline": pipe,
        "tp_grid": grids,
    }


STEP_KEYS = ("ring", "pipeline", "tp_grid")
"""Results of :func:`_in_step_body` besides the in-step all-reduce (pairs of ranks)."""


def calibrate_body(ctx: Any, quick: bool) -> dict[str, Any]:
    """The whole calibration on one rank (a :class:`~plait.testing.WorkerPool` body)."""
    sizes = MESSAGE_BYTES[:4] if quick else MESSAGE_BYTES
    reps = 5 if quick else 15
    comms = _collective_body(ctx, sizes, reps)
    step = _in_step_body(ctx, quick)
    comms.update({k: v for k, v in step.items() if k not in ("cpu", *STEP_KEYS)})
    comms["cpu"].update(step["cpu"])
    out = {"compute": compute_body(ctx, quick), "comm": comms}
    for key in STEP_KEYS:
        if key in step:
            out[key] = step[key]
    return out


def _slowest(comms: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Per operation and message size, the slowest rank's time: a collective is done
    when its last rank is (and on one rank's clock the peer's share is invisible)."""
    ops = [op for op in comms[0] if op != "cpu"]
    out: dict[str, list[tuple[float, float]]] = {}
    for op in ops:
        pts = [c.get(op, []) for c in comms]
        if not pts[0] or any(len(p) != len(pts[0]) for p in pts):
            continue
        out[op] = [(pts[0][i][0], max(p[i][1] for p in pts)) for i in range(len(pts[0]))]
    return out


def _on_clock(part: dict[str, Any], clock: str) -> dict[str, Any]:
    """A body's result on ``clock`` (the top level is the wall clock)."""
    if clock not in CLOCKS:
        raise ValueError(f"unknown clock {clock!r}; use one of {tuple(CLOCKS)}")
    return part if clock == "wall" else part["cpu"]


def profile_from_results(
    results: list[dict[str, Any]],
    memory_bytes: float | None = None,
    name: str = "cpu",
    clock: str = "wall",
) -> tuple[Hardware, list[Fit]]:
    """A :class:`Hardware` from every rank's measurements (and the collective fits), on
    the wall clock or in CPU time (``clock="cpu"``)."""
    n = len(results)
    fields = compute_fields([_on_clock(r["compute"], clock) for r in results])
    comm = _slowest([_on_clock(r["comm"], clock) for r in results])
    shape = {
        "all_reduce": (2.0 * (n - 1), 2.0 * (n - 1) / n),
        "all_gather": (n - 1.0, (n - 1.0) / n),
        "reduce_scatter": (n - 1.0, (n - 1.0) / n),
        "p2p": (1.0, 1.0),
    }
    fits = []
    for op, (steps, factor) in shape.items():
        pts = tuple((float(s), float(t)) for s, t in comm.get(op, []))
        if len(pts) >= 2 and n >= 2:
            a, b = fit_alpha_beta(pts, steps, factor)
            fits.append(Fit(op, a, b, pts))
    ar = next((f for f in fits if f.op == "all_reduce"), None)
    cores = os.cpu_count() or 1
    if memory_bytes is None:
        try:
            memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / cores
        except (ValueError, OSError, AttributeError):
            memory_bytes = 4e9
    link = Link(
        ar.alpha if ar else 0.0,
        ar.bandwidth if ar else 1e9,
        tuple((f.op, f.alpha, f.bandwidth) for f in fits),
        # the measurements themselves, interpolated for groups of this size
        tuple((f.op, n, Curve(f.points)) for f in fits)
        # TP-style all-reduces, as a step issues them, on pairs of ranks
        + (((IN_STEP, 2, Curve(tuple(comm[IN_STEP]))),) if comm.get(IN_STEP) else ()),
    )
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    hw = Hardware(
        name=name,
        comm_overlap=0.0,  # one core per rank: gloo's threads move bytes on those cores
        memory_bytes=float(memory_bytes),
        devices_per_node=cores,
        intra=link,
        inter=link,
        source=(
            f"measured by plait bench calibrate on {platform.node() or 'this machine'} "
            f"({platform.processor() or platform.machine()}, {cores} cores), {n} gloo ranks "
            f"x 1 thread, torch fp32, {'CPU time' if clock == 'cpu' else 'wall clock'}, "
            f"{stamp}; memory = host RAM / cores"
        ),
        **fields,
    )
    hw = with_block_costs(hw, [_on_clock(r["compute"], clock) for r in results])
    if all("ring" in r for r in results):  # the slowest rank's tiny ring, pairs of ranks
        hw = replace(hw, ring_overhead_s=ring_overhead(hw, max(r["ring"][clock] for r in results)))
    if all("pipeline" in r for r in results):  # the slowest rank's tiny pipeline step
        x, k = pipeline_overhead(hw, [r["pipeline"] for r in results], clock)
        hw = replace(hw, pp_action_overhead_s=x, pp_action_per_work=k)
    if all("tp_grid" in r for r in results):  # tensor-parallel blocks on the pairs
        hw = with_tp_grids(hw, [r["tp_grid"] for r in results], clock)
    return hw, fits


def calibrate(
    nproc: int = 2, quick: bool = False, pool: Any = None, memory_bytes: float | None = None
) -> tuple[Hardware, list[Fit]]:
    """Measure this machine with ``nproc`` ranks (a fresh pool unless one is given)."""
    from plait.testing import WorkerPool

    own = pool is None
    p = WorkerPool(nproc, comm_timeout_s=120.0) if own else pool
    try:
        results = p.run("plait.bench.calibrate:calibrate_body", quick, timeout_s=600.0)
    finally:
        if own:
            p.close()
    hw, fits = profile_from_results(results, memory_bytes)
    from plait.bench.cpu_adam import cpu_adam_params_per_s  # ZeRO-Offload's host step

    return replace(hw, cpu_adam_params_per_s=cpu_adam_params_per_s(quick)), fits
