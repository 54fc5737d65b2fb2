"""One layout of a query, evaluated: the dense model's memory and time, or the
mixture-of-experts model's when the query has one (:mod:`plait.plan.moe_estimate`)."""

from __future__ import annotations

from plait.plan.estimate import Estimate, estimate
from plait.plan.layout import Layout
from plait.plan.memory import MemoryBreakdown, memory_per_rank
from plait.plan.moe_estimate import moe_estimate, moe_memory
from plait.plan.query import Query


def layout_memory(q: Query, layout: Layout) -> MemoryBreakdown:
    """The worst rank's memory of ``layout`` for ``q`` (the MoE model's when ``q.moe``)."""
    if q.moe is not None:
        return moe_memory(q.model, q.moe, layout, q.precision, q.runtime, q.seq_len)
    return memory_per_rank(q.model, layout, q.precision, q.runtime, q.seq_len)


def layout_estimate(q: Query, layout: Layout) -> Estimate:
    """The estimate of ``layout`` for ``q`` (the MoE model's when ``q.moe``)."""
    args = (layout, q.hardware, q.precision, q.runtime, q.seq_len, q.headroom)
    if q.moe is not None:
        return moe_estimate(q.model, q.moe, *args)
    return estimate(q.model, *args)
