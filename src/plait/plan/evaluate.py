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
    return moe_memory(q, layout) if q.moe is not None else memory_per_rank(q, layout)


def layout_estimate(q: Query, layout: Layout) -> Estimate:
    """The estimate of ``layout`` for ``q`` (the MoE model's when ``q.moe``)."""
    return moe_estimate(q, layout) if q.moe is not None else estimate(q, layout)
