"""ZeRO-2/3 under pipeline parallelism: the data-parallel traffic of one step.

The runtime (:mod:`plait.parallel.pipeline.zero`) reduce-scatters each unit's gradients
once per step or once per backward action (``Layout.pp_grad_reduce``) and, at stage 3,
gathers each piece once per step or before each of its actions
(``Layout.pp_reshard``); the memory side is
:func:`plait.plan.memory.pipeline_zero_buffer_bytes`.
"""

from __future__ import annotations

from plait.plan.layout import Layout
from plait.plan.network import Group, all_gather_time, reduce_scatter_time


def pipeline_zero_comm(
    layout: Layout, shard: Group, ag_bytes: float, rs_bytes: float, cross: float
) -> tuple[float, float]:
    """(exposed, total) seconds of ZeRO-2/3 traffic under pp
    (:mod:`plait.parallel.pipeline.zero`): reduce-scatters once per step
    (``pp_grad_reduce = "step"``, overlapping the rest of the schedule except the last
    piece's) or once per micro-batch (exposed: the same share); stage 2 all-gathers the
    updated parameters once after the step; stage 3 gathers once per step, or each piece
    before each of its forward and backward actions with ``pp_reshard`` and
    several pieces per rank (an upper bound: consecutive actions of one piece share a
    gather; blocking, no prefetch across actions)."""
    m, v = layout.microbatches, layout.chunks
    rs = reduce_scatter_time(rs_bytes, shard.size, shard.link)
    ag = all_gather_time(ag_bytes, shard.size, shard.link)
    reductions = rs if layout.pp_grad_reduce == "step" else m * rs
    exposed_rs = reductions / v  # the last piece's reductions end the step
    if layout.zero == 2:
        return exposed_rs + ag + cross, reductions + ag + cross
    regather = layout.pp_reshard and v > 1  # one piece per rank stays gathered
    gathers = 2 * m * ag if regather else ag
    return exposed_rs + gathers + cross, reductions + gathers + cross
