"""The tests' shorthand for the planner's bundled question: the :class:`Query` of one
layout (its devices and global batch), from the pieces a test names."""

from __future__ import annotations

from plait.plan import HARDWARE_PRESETS, Hardware, Layout, ModelSpec, Precision, Runtime
from plait.plan.moe import MoESpec
from plait.plan.query import Query

MEMORY_ONLY = HARDWARE_PRESETS["a100-80gb"]
"""The device of a query that only memory is asked of (memory does not read it)."""


def query(
    spec: ModelSpec,
    layout: Layout,
    precision: Precision,
    runtime: Runtime,
    seq_len: int,
    hardware: Hardware = MEMORY_ONLY,
    headroom: float = 0.0,
    moe: MoESpec | None = None,
) -> Query:
    """The query of ``layout`` (no headroom unless given)."""
    return Query.of_layout(spec, layout, hardware, precision, runtime, seq_len, headroom, moe)
