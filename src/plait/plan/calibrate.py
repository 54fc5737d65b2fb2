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
  reduce-scatter; 1 and S for a message).

Every timing is a median over repetitions. The result is a :class:`Hardware` profile
that :func:`plait.plan.hardware.dump_hardware` writes and ``plait plan --hardware``
reads. This module is the only part of :mod:`plait.plan` that needs processes; it
imports the communication layer inside its functions.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from plait.plan.hardware import Curve, Hardware, Link

MATMUL_SIZES = (64, 128, 256, 512, 1024)
ATTENTION_SEQS = (64, 128, 256, 512)
ELEMENTWISE_ELEMS = (2**12, 2**14, 2**16, 2**18, 2**20, 2**21)
LINEAR_SIZES = (32, 64, 128, 256, 512)
MESSAGE_BYTES = (2**10, 2**13, 2**16, 2**19, 2**22, 2**24)
ATTN_BATCH, ATTN_HEADS, ATTN_HEAD_DIM = 4, 4, 32


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
"""``wall``: elapsed seconds, what a dedicated machine shows. ``cpu``: this process's CPU
seconds (every thread), blind to time spent descheduled, so a profile measured with it
on a shared machine predicts the work a step costs, not how long others delay it."""

Points = dict[str, list[tuple[float, float]]]
"""``(size, rate)`` points per clock."""


def _median_times(fn: Callable[[], object], reps: int, min_time: float = 0.0) -> dict[str, float]:
    """Median seconds of ``fn()`` over ``reps`` runs (after one warm-up) on every clock of
    :data:`CLOCKS`; calls are grouped so that each timed group lasts at least
    ``min_time``."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-9)
    inner = max(1, int(min_time / once))
    samples: dict[str, list[float]] = {c: [] for c in CLOCKS}
    for _ in range(reps):
        start = {c: clock() for c, clock in CLOCKS.items()}
        for _ in range(inner):
            fn()
        for c, clock in CLOCKS.items():
            samples[c].append(max(clock() - start[c], 1e-9) / inner)
    return {c: statistics.median(v) for c, v in samples.items()}


def _rates(points: list[tuple[float, dict[str, float]]], work: Callable[[float], float]) -> Points:
    """``(size, seconds per clock)`` -> ``(size, work(size) / seconds)`` per clock."""
    return {c: [(size, work(size) / t[c]) for size, t in points] for c in CLOCKS}


def measure_matmul(sizes: Sequence[int], reps: int) -> Points:
    """``(n, FLOP/s)`` of an fp32 n x n x n matmul."""
    import torch

    out = []
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out.append((float(n), _median_times(functools.partial(torch.mm, a, b), reps, 0.02)))
    return _rates(out, lambda n: 2.0 * n**3)


def measure_attention(seqs: Sequence[int], reps: int) -> Points:
    """``(s, FLOP/s)`` of causal SDPA forward + backward, FLOPs = 3 x 4·b·s²·a·d."""
    import torch
    import torch.nn.functional as F

    out = []
    b, a, d = ATTN_BATCH, ATTN_HEADS, ATTN_HEAD_DIM
    for s in seqs:
        q, k, v = (torch.randn(b, a, s, d, requires_grad=True) for _ in range(3))
        g = torch.randn(b, a, s, d)

        def step(q: Any = q, k: Any = k, v: Any = v, g: Any = g) -> None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(g)

        out.append((float(s), _median_times(step, reps, 0.02)))
    return _rates(out, lambda s: 3 * 4.0 * b * s * s * a * d)


MEMORY_BOUND_ELEMENTS = 6 + 9 + 5 + 3
"""Forward elements read or written per element of the calibration chain, as
:func:`plait.plan.compute.block_traffic` charges them: an unfused RMSNorm (6), rotary
(9), silu(a)·b (5), a residual add (3)."""


def measure_elementwise(elems: Sequence[int], reps: int) -> Points:
    """``(tensor bytes, bytes/s)`` of the memory-bound layers of a block *in training*:
    an RMSNorm written in plain PyTorch, a rotary-style rotation of halves, silu(a)·b and
    a residual add on an ``(n/128, 128)`` fp32 tensor, forward and backward, charged as
    the planner charges them (:data:`MEMORY_BOUND_ELEMENTS` x 4 bytes forward, twice that
    backward). Short autograd chains cost far more per byte than one streaming kernel
    (on a CPU ~3x for this chain), so the rate is measured on the chain, not on ``a*b``."""
    import torch
    import torch.nn.functional as F

    out = []
    for n in elems:
        rows = max(1, n // 128)
        x = torch.randn(rows, 128, requires_grad=True)
        w = torch.ones(128, requires_grad=True)
        c, sn = torch.rand(1, 64), torch.rand(1, 64)
        g = torch.randn(rows, 128)

        def step(x: Any = x, w: Any = w, c: Any = c, sn: Any = sn, g: Any = g) -> None:
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w  # RMSNorm
            y1, y2 = y.chunk(2, dim=-1)
            r = torch.cat((y1 * c - y2 * sn, y1 * sn + y2 * c), dim=-1)  # rotary
            z = F.silu(r) * y  # SwiGLU's activation
            (z + x).backward(g)  # residual

        out.append((4.0 * rows * 128, _median_times(step, reps, 0.01)))
    charged = 3.0 * MEMORY_BOUND_ELEMENTS  # forward + backward (2x)
    return _rates(out, lambda nbytes: charged * nbytes)


def measure_linear(sizes: Sequence[int], reps: int) -> Points:
    """``(size, FLOP/s)`` of a linear layer *in training*: ``y = x·Wᵀ`` with x ``(4n, n)``
    and W ``(n, n)``, forward and both gradients (three GEMMs of ``2·M·K·N`` FLOPs, some
    on transposed operands, and the gradient accumulation); size ``(M·K·N)^(1/3)``."""
    import torch

    out = []
    for n in sizes:
        x = torch.randn(4 * n, n, requires_grad=True)
        w = torch.randn(n, n, requires_grad=True)
        g = torch.randn(4 * n, n)

        def step(x: Any = x, w: Any = w, g: Any = g) -> None:
            (x @ w.t()).backward(g)

        out.append(((4.0 * n**3) ** (1.0 / 3.0), _median_times(step, reps, 0.02)))
    return _rates(out, lambda size: 3 * 2.0 * size**3)


def measure_op_overhead(reps: int) -> dict[str, float]:
    """Seconds of one operator call on a one-element tensor (dispatch cost), per clock."""
    import torch

    x, y = torch.ones(1), torch.ones(1)
    return _median_times(lambda: torch.add(x, y), reps, 0.01)


def measure_optimizer(params: int, tensors: int, reps: int) -> dict[str, float]:
    """Bytes/s of AdamW + gradient clipping per clock, charged 40 bytes per fp32
    parameter (the traffic :func:`plait.plan.estimate.step_time` uses: weights and two
    moments read and written, the gradient read once for the update and three times for
    clipping)."""
    import torch

    per = max(1, params // tensors)
    ps = [torch.nn.Parameter(torch.randn(per)) for _ in range(tensors)]
    for p in ps:
        p.grad = torch.randn(per)
    opt = torch.optim.AdamW(ps, lr=1e-3)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(ps, 1.0)
        opt.step()

    t = _median_times(step, reps)
    return {c: 40.0 * per * tensors / t[c] for c in CLOCKS}


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


def compute_body(ctx: Any, quick: bool) -> dict[str, Any]:
    """On every rank at once: the compute measurements (wall clock; CPU time under
    ``"cpu"``)."""
    import torch

    torch.set_num_threads(1)
    reps = 3 if quick else 7
    sizes = MATMUL_SIZES[:4] if quick else MATMUL_SIZES
    mm = measure_matmul(sizes, reps)
    lin = measure_linear(LINEAR_SIZES[:4] if quick else LINEAR_SIZES, reps)
    at = measure_attention(ATTENTION_SEQS[:3] if quick else ATTENTION_SEQS, reps)
    ew = measure_elementwise(ELEMENTWISE_ELEMS[:4] if quick else ELEMENTWISE_ELEMS, reps)
    oo = measure_op_overhead(reps)
    op = measure_optimizer(2**19 if quick else 2**21, 16, reps)
    per = {
        c: {
            "matmul": mm[c],
            "linear": lin[c],
            "attention": at[c],
            "elementwise": ew[c],
            "op_overhead": oo[c],
            "optimizer": op[c],
        }
        for c in CLOCKS
    }
    return {**per["wall"], "cpu": per["cpu"]}


def calibrate_body(ctx: Any, quick: bool) -> dict[str, Any]:
    """The whole calibration on one rank (a :class:`~plait.testing.WorkerPool` body)."""
    sizes = MESSAGE_BYTES[:4] if quick else MESSAGE_BYTES
    reps = 5 if quick else 15
    return {"compute": compute_body(ctx, quick), "comm": _collective_body(ctx, sizes, reps)}


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


def _merge(curves: list[list[tuple[float, float]]]) -> Curve:
    """The median over ranks (and runs) of each point; all measured the same sizes."""
    pts = [
        (curves[0][i][0], statistics.median(c[i][1] for c in curves)) for i in range(len(curves[0]))
    ]
    return Curve(tuple(pts))


def _compute_fields(comp: list[dict[str, Any]]) -> dict[str, Any]:
    """Hardware fields from every rank's :func:`compute_body` result."""
    square = _merge([c["matmul"] for c in comp])
    # the rate a linear layer trains at (forward and backward GEMMs) where measured
    linear = _merge([c["linear"] for c in comp]) if all("linear" in c for c in comp) else square
    return {
        "peak_flops": square.peak,
        "matmul": linear,
        "attention": _merge([c["attention"] for c in comp]),
        "elementwise": _merge([c["elementwise"] for c in comp]),
        "op_overhead_s": statistics.median(c["op_overhead"] for c in comp),
        "optimizer_bandwidth": statistics.median(c["optimizer"] for c in comp),
    }


def with_compute(hw: Hardware, comp: list[dict[str, Any]]) -> Hardware:
    """``hw`` with its compute rates replaced by fresh :func:`compute_body` results
    (several runs' results may be pooled: each point is the median over all)."""
    return replace(hw, **_compute_fields(comp))


def profile_from_results(
    results: list[dict[str, Any]],
    memory_bytes: float | None = None,
    name: str = "cpu",
    clock: str = "wall",
) -> tuple[Hardware, list[Fit]]:
    """A :class:`Hardware` from every rank's measurements (and the collective fits), on
    the wall clock or in CPU time (``clock="cpu"``)."""
    n = len(results)
    fields = _compute_fields([_on_clock(r["compute"], clock) for r in results])
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
        tuple((f.op, n, Curve(f.points)) for f in fits),
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
    return hw, fits


def calibrate(
    nproc: int = 2, quick: bool = False, pool: Any = None, memory_bytes: float | None = None
) -> tuple[Hardware, list[Fit]]:
    """Measure this machine with ``nproc`` ranks (a fresh pool unless one is given)."""
    from plait.testing import WorkerPool

    own = pool is None
    p = WorkerPool(nproc, comm_timeout_s=120.0) if own else pool
    try:
        results = p.run("plait.plan.calibrate:calibrate_body", quick, timeout_s=600.0)
    finally:
        if own:
            p.close()
    return profile_from_results(results, memory_bytes)
