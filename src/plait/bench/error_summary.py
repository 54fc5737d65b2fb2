"""The planner's step-time errors over many (shape, layout) cells, summarised per layout.

``benchmarks/planner_vs_measured.py --shapes N`` measures every layout on every drawn shape
(:mod:`plait.bench.random_shapes`); each measurement is a :class:`Cell`. Issue 46's claim
is made on their distribution: per layout and over all cells, the median |error|, the
worst error (signed, the largest |error|) and how many cells lie within :data:`WITHIN`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

WITHIN = 0.20
"""The |error| bound counted per layout (issue 46's target: every cell within it)."""
ALL = "all cells"
"""The label of the summary over every cell."""


@dataclass(frozen=True)
class Cell:
    """One layout measured on one shape."""

    layout: str
    """The layout's row name."""
    shape: str
    """The shape's label."""
    error: float
    """(predicted - measured) / measured step time."""


@dataclass(frozen=True)
class Summary:
    """The error distribution of one layout's cells (or of all of them)."""

    layout: str
    """The layout's row name, or :data:`ALL`."""
    cells: int
    """Cells summarised."""
    median_abs: float
    """Median |error|."""
    worst: float
    """The error of largest magnitude, signed."""
    within: int
    """Cells with |error| <= :data:`WITHIN`."""


def summarize_one(layout: str, errors: Sequence[float]) -> Summary:
    """The :class:`Summary` of ``errors`` (at least one)."""
    if not errors:
        raise ValueError(f"no cells for {layout!r}")
    return Summary(
        layout=layout,
        cells=len(errors),
        median_abs=statistics.median(abs(e) for e in errors),
        worst=max(errors, key=abs),
        within=sum(abs(e) <= WITHIN for e in errors),
    )


def summarize(cells: Sequence[Cell]) -> list[Summary]:
    """One :class:`Summary` per layout, in the order layouts first appear, then one over
    all cells."""
    layouts = list(dict.fromkeys(c.layout for c in cells))
    per = [summarize_one(lay, [c.error for c in cells if c.layout == lay]) for lay in layouts]
    return [*per, summarize_one(ALL, [c.error for c in cells])]


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def summary_table(cells: Sequence[Cell], clock: str) -> list[str]:
    """The per-layout distribution as a markdown table (``clock``: its label)."""
    lines = [
        f"| layout | cells | {clock} median abs err | worst | within {100 * WITHIN:.0f}% |",
        "|---|---|---|---|---|",
    ]
    for s in summarize(cells):
        lines.append(
            f"| {s.layout} | {s.cells} | {100 * s.median_abs:.1f}% | {_pct(s.worst)} | "
            f"{s.within}/{s.cells} |"
        )
    return lines


def cells_table(cells: Sequence[Cell]) -> list[str]:
    """Every cell's error: a row per shape, a column per layout (blank: not measured)."""
    layouts = list(dict.fromkeys(c.layout for c in cells))
    shapes = list(dict.fromkeys(c.shape for c in cells))
    by = {(c.shape, c.layout): c.error for c in cells}
    lines = ["| shape | " + " | ".join(layouts) + " |", "|---" * (len(layouts) + 1) + "|"]
    for s in shapes:
        errs = [_pct(by[s, lay]) if (s, lay) in by else "" for lay in layouts]
        lines.append(f"| {s} | " + " | ".join(errs) + " |")
    return lines
