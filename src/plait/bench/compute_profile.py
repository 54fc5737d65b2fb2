"""The compute side of a profile from measurements: rate curves pooled over ranks, and
the block's fixed cost and composition ratio derived from what the planner charges.

:mod:`plait.bench.calibrate` measures (every rank runs
:func:`plait.bench.measure.compute_body`) and assembles the profile; this module turns
the ranks' compute results into :class:`~plait.plan.hardware.Hardware` fields:

* :func:`compute_fields`: each rate curve, every point the median over ranks
  (``peak_flops`` the square matmul's best);
* :func:`block_overhead`: the tiny block's measured seconds beyond its charge
  (``block_overhead_s``);
* :func:`block_scale_points`: the block grid's measured / charged ratios
  (``block_scale``), charged by :func:`block_grid_charge` without a scale.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from plait.plan.hardware import Curve, Hardware

__all__ = [
    "block_grid_charge",
    "block_overhead",
    "block_scale_points",
    "compute_fields",
    "tiny_block_charge",
    "with_block_costs",
    "with_compute",
]


def _merge(curves: list[list[tuple[float, float]]]) -> Curve:
    """The median over ranks (and runs) of each point; all measured the same sizes."""
    pts = [
        (curves[0][i][0], statistics.median(c[i][1] for c in curves)) for i in range(len(curves[0]))
    ]
    return Curve(tuple(pts))


def compute_fields(comp: list[dict[str, Any]]) -> dict[str, Any]:
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


def tiny_block_charge(hw: Hardware) -> float:
    """Seconds the planner charges the tiny block of :data:`plait.bench.measure.TINY_BLOCK`
    (forward + backward) with ``hw``'s rates and fixed costs."""
    from plait.bench.measure import TINY_BATCH, tiny_block_config
    from plait.plan.compute import block_time
    from plait.plan.layout import PRECISIONS, Layout, Runtime
    from plait.plan.modelspec import ModelSpec
    from plait.plan.query import Query

    cfg = tiny_block_config()
    spec = ModelSpec.from_config(cfg, "tiny-block")
    lay = Layout(micro_batch=TINY_BATCH)
    bt = block_time(
        Query.of_layout(spec, lay, hw, PRECISIONS["fp32"], Runtime(), cfg.max_seq_len), lay
    )
    return bt.forward + bt.backward


def block_overhead(hw: Hardware, measured_s: float) -> float:
    """The fixed cost of a block: the tiny block's measured seconds minus what ``hw``
    (without a block overhead) charges for it, at least 0."""
    return max(0.0, measured_s - tiny_block_charge(replace(hw, block_overhead_s=0.0)))


def block_grid_charge(hw: Hardware, dim: float, tokens: float) -> float:
    """Seconds the planner charges one block of the grid
    (:func:`plait.bench.measure.block_grid_config`) at hidden size ``dim`` and ``tokens``
    per micro-batch, forward + backward, with ``hw``'s rates, fixed costs and scale."""
    from plait.bench.measure import BLOCK_GRID_SEQ, block_grid_config
    from plait.plan.compute import block_time
    from plait.plan.layout import PRECISIONS, Layout, Runtime
    from plait.plan.modelspec import ModelSpec
    from plait.plan.query import Query

    spec = ModelSpec.from_config(block_grid_config(int(dim)), "block-grid")
    lay = Layout(micro_batch=max(1, round(tokens / BLOCK_GRID_SEQ)))
    bt = block_time(
        Query.of_layout(spec, lay, hw, PRECISIONS["fp32"], Runtime(), BLOCK_GRID_SEQ), lay
    )
    return bt.forward + bt.backward


def block_scale_points(
    hw: Hardware, measured: Sequence[tuple[float, float, float]]
) -> tuple[tuple[float, float, float], ...]:
    """``(hidden, tokens, measured / charged)`` for each measured grid block, charged by
    ``hw`` without a scale (its block overhead included)."""
    base = replace(hw, block_scale=())
    return tuple((d, t, sec / block_grid_charge(base, d, t)) for d, t, sec in measured)


def with_block_costs(hw: Hardware, comp: list[dict[str, Any]]) -> Hardware:
    """``hw`` with the block's fixed cost (the tiny block) and then its composition
    ratio on the grid (each grid point the median over ``comp``) derived."""
    if not all("tiny_block" in c for c in comp):
        return hw
    tiny = statistics.median(c["tiny_block"] for c in comp)
    hw = replace(hw, block_overhead_s=block_overhead(hw, tiny))
    if not all(c.get("block_grid") for c in comp):
        return hw
    grid = comp[0]["block_grid"]
    pooled = [
        (d, t, statistics.median(c["block_grid"][i][2] for c in comp))
        for i, (d, t, _) in enumerate(grid)
    ]
    return replace(hw, block_scale=block_scale_points(hw, pooled))


def with_compute(hw: Hardware, comp: list[dict[str, Any]]) -> Hardware:
    """``hw`` with its compute rates replaced by fresh :func:`compute_body` results
    (several runs' results may be pooled: each point is the median over all)."""
    return with_block_costs(replace(hw, **compute_fields(comp)), comp)
