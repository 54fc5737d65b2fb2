"""Data-parallel and ZeRO traffic of one step, and how much of it the backward hides.

Gradient buckets are reduced as their gradients become ready, so only ``max(last
bucket, comm - (1 - 1/buckets)·backward)`` is exposed. ZeRO-1/2 reduce-scatter
gradients the same way and all-gather the updated weights after the step (exposed);
ZeRO-3 all-gathers every unit before its forward and backward and reduce-scatters its
gradients, with the next unit prefetched, exposing ``max(one unit, comm - compute)`` per
micro-batch; under pipeline parallelism the schedule drives ZeRO-2/3
(:mod:`plait.plan.pipeline_zero`). Compressed gradients: :mod:`plait.plan.compression`.
"""

from __future__ import annotations

import math

from plait.plan.compression import traffic
from plait.plan.layout import Layout
from plait.plan.network import all_gather_time, all_reduce_time, group, reduce_scatter_time
from plait.plan.overheads import in_step_time, zero3_unit_numels
from plait.plan.pipeline_zero import pipeline_zero_comm
from plait.plan.query import Query


def dp_comm_time(
    q: Query, layout: Layout, params: int, fwd: float, bwd: float
) -> tuple[float, float]:
    """(exposed, total) seconds of data-parallel / ZeRO traffic per step of a rank
    holding ``params`` parameters, whose micro-batch takes ``fwd`` seconds forward and
    ``bwd`` backward (with recomputation)."""
    spec, hw, precision, runtime = q.model, q.hardware, q.precision, q.runtime
    grads = params * precision.grad_bytes
    weights = params * precision.param_bytes
    bucket = runtime.bucket_mb * 2**20
    nb = max(1, math.ceil(grads / bucket))
    ov = hw.comm_overlap
    window = ov * bwd * (1 - 1 / nb)  # backward left after the first bucket is ready
    f = layout.shard_factor
    if layout.zero == 0:
        g = group(layout, hw, "dp+cp")
        if g.size == 1:
            return 0.0, 0.0
        if layout.compression != "none":
            return _compressed(q, layout, params, nb, window)
        # each bucket's all-reduce is waited for in the step (plan.overheads)
        comm = nb * in_step_time("all_reduce", grads / nb, g.size, g.link)
        return max(comm / nb, comm - window), comm
    shard = group(layout, hw, "dp", size=f)
    replica = group(layout, hw, "dp", size=layout.dp // f, step=f)
    cpg = group(layout, hw, "cp")
    cross = all_reduce_time(grads / f, replica.size, replica.link)  # hybrid: across groups
    cross += all_reduce_time(grads, cpg.size, cpg.link)  # cp ranks share the weights
    if layout.zero >= 2 and layout.pp > 1:  # the pipeline drives ZeRO-2/3
        return pipeline_zero_comm(layout, shard, ag_bytes=weights, rs_bytes=grads, cross=cross)
    if layout.zero in (1, 2):
        rs = nb * reduce_scatter_time(grads / nb, shard.size, shard.link)
        ag = all_gather_time(weights, shard.size, shard.link)
        exposed = max(rs / nb, rs - window) + ag + cross
        return exposed, rs + ag + cross
    # one gather per unit before its forward and its backward, one reduce-scatter after
    # its backward, each synchronous in the step (plan.overheads.in_step_time); the
    # units the runtime has (embedding, blocks, head, root), each paying its latency
    numels = zero3_unit_numels(spec, layout, params)
    agus = [
        in_step_time("all_gather", n * precision.param_bytes, shard.size, shard.link)
        for n in numels
    ]
    rsus = [
        in_step_time("reduce_scatter", n * precision.grad_bytes, shard.size, shard.link)
        for n in numels
    ]
    ag, rs = sum(agus), sum(rsus)
    agu, rsu = max(agus), max(rsus)
    m = layout.microbatches
    per_mb = max(agu, ag - ov * fwd) + max(agu + rsu, ag + rs - ov * bwd)
    return m * per_mb + cross, m * (2 * ag + rs) + cross


def _compressed(
    q: Query, layout: Layout, params: int, nb: int, window: float
) -> tuple[float, float]:
    """(exposed, total) seconds of compressed data-parallel traffic plus its compute
    (:mod:`plait.plan.compression`) in ``nb`` buckets, ``window`` seconds to hide under."""
    hw, precision = q.hardware, q.precision
    g = group(layout, hw, "dp+cp")
    c = traffic(
        q.model,
        hw,
        layout.compression,
        params,
        precision.grad_bytes,
        g.size,
        layout.tp,
        layout.compression_ratio,
        layout.compression_rank,
    )
    if c.op == "all_gather":
        comm = nb * all_gather_time(c.wire_bytes / nb, g.size, g.link)
    else:
        comm = nb * all_reduce_time(c.wire_bytes / nb, g.size, g.link)
    if c.overlapped:
        return max(comm / nb, comm - window) + c.compute_s, comm + c.compute_s
    return comm + c.compute_s, comm + c.compute_s
