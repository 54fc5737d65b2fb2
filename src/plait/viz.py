"""Pictures: pipeline timelines as Gantt charts (PNG, matplotlib's Agg canvas).

:func:`draw_timeline` draws any list of ``(rank, action, start, end)`` records -- a
simulated timeline (:func:`plait.parallel.pipeline.simulate.simulate`) or one measured
by the pipeline runtime (its records, or their ``as_tuple()``) -- with ranks as rows
(rank 0 on top), forward / backward / input-gradient / weight-gradient in distinct
colours (a darker shade for later model chunks), the micro-batch number inside each bar
when it fits, communication as a thin grey line under the row, and idle time left
white. The title carries the bubble fraction: the share of rank-time not spent in
compute actions, ``1 - busy / (ranks x makespan)``.

No pyplot: figures are built on their own Agg canvas, so nothing global changes and it
works without a display.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from plait.errors import ConfigError
from plait.parallel.pipeline.actions import Action, Op, Schedule

COLORS: dict[Op, str] = {
    Op.FORWARD: "#1f77b4",  # blue
    Op.BACKWARD: "#2ca02c",  # green
    Op.BACKWARD_INPUT: "#ff7f0e",  # orange
    Op.BACKWARD_WEIGHT: "#9467bd",  # purple
}
"""Bar colour of each compute action (chunk 0; later chunks are darker)."""
COMM_COLOR = "#7f7f7f"
"""Colour of the thin line marking communication."""
LABELS = {
    Op.FORWARD: "forward",
    Op.BACKWARD: "backward",
    Op.BACKWARD_INPUT: "backward (input grad)",
    Op.BACKWARD_WEIGHT: "weight grad",
}

Record = tuple[int, Action, float, float]


def as_records(records: Iterable[Any]) -> list[Record]:
    """Normalise records: tuples ``(rank, action, start, end)`` or objects with those
    attributes (the simulator's ``Event``, the runtime's ``ActionRecord``)."""
    out: list[Record] = []
    for rec in records:
        if isinstance(rec, tuple):
            rank, action, start, end = rec
        else:
            rank, action, start, end = rec.rank, rec.action, rec.start, rec.end
        if not isinstance(action, Action):
            raise ConfigError(f"timeline record {rec!r}: the action is not an Action")
        out.append((int(rank), action, float(start), float(end)))
    return out


def bubble_fraction(records: Sequence[Record], ranks: int | None = None) -> float:
    """``1 - busy / (ranks x makespan)`` of a timeline; the makespan runs from the
    earliest start to the latest end over all ranks."""
    if not records:
        raise ConfigError("an empty timeline has no bubble fraction")
    n = ranks if ranks is not None else 1 + max(r for r, *_ in records)
    t0 = min(s for _, _, s, _ in records)
    span = max(e for *_, e in records) - t0
    busy = sum(e - s for _, a, s, e in records if a.op.is_compute)
    return 1.0 - busy / (n * span) if span > 0 else 0.0


def _shade(color: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """``color`` darkened by up to 45% for later chunks."""
    h = color.lstrip("#")
    rgb = [int(h[k : k + 2], 16) / 255 for k in (0, 2, 4)]
    f = 1.0 - 0.45 * chunk / max(chunks - 1, 1)
    return (rgb[0] * f, rgb[1] * f, rgb[2] * f)


MAX_FIGURE_INCHES = 40.0
"""Tallest chart drawn (inches); more ranks share the height."""
MAX_LABELLED = 2000
"""Charts of more records get no micro-batch numbers on the bars (they would not fit)."""


def draw_timeline(
    records: Iterable[Any],
    out: str | Path,
    title: str = "pipeline timeline",
    ranks: int | None = None,
    chunks: int | None = None,
    unit: str = "",
    dpi: int = 110,
) -> float:
    """Draw a Gantt chart of ``records`` into the PNG ``out``; returns the bubble fraction
    (also shown in the title). ``ranks`` / ``chunks`` default to what the records show;
    ``unit`` labels the time axis (e.g. "ms")."""
    recs = as_records(records)
    if not recs:
        raise ConfigError("nothing to draw: the timeline has no records")
    p = ranks if ranks is not None else 1 + max(r for r, *_ in recs)
    v = chunks if chunks is not None else 1 + max(a.stage // p for _, a, _, _ in recs)
    bubble = bubble_fraction(recs, p)
    t0 = min(s for _, _, s, _ in recs)
    span = max(e for *_, e in recs) - t0
    # at most MAX_FIGURE_INCHES tall: a chart of hundreds of ranks stays a bounded image
    fig = Figure(
        figsize=(min(4 + 0.32 * len(recs) / p, 18), min(0.9 + 0.55 * p, MAX_FIGURE_INCHES)), dpi=dpi
    )
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bars: dict[tuple[int, Any], list[tuple[float, float]]] = {}  # (row, colour) -> spans
    comms: dict[int, list[tuple[float, float]]] = {}
    label = len(recs) <= MAX_LABELLED
    for rank, a, s, e in recs:
        y = p - 1 - rank
        if a.op.is_comm:
            comms.setdefault(y, []).append((s - t0, max(e - s, span * 0.002)))
            continue
        bars.setdefault((y, _shade(COLORS[a.op], a.stage // p, v)), []).append((s - t0, e - s))
        if label and (e - s) / span > 0.012 * len(str(a.microbatch)):
            ax.text(
                s - t0 + (e - s) / 2,
                y,
                str(a.microbatch),
                ha="center",
                va="center",
                color="white",
                fontsize=7,
            )
    for (y, color), spans in bars.items():  # one collection per row and colour: fast
        ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color, edgecolor="white", linewidth=0.6)
    for y, spans in comms.items():
        ax.broken_barh(spans, (y - 0.44, 0.04), facecolors=COMM_COLOR, linewidth=0)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {p - 1 - y}" for y in range(p)])
    ax.set_ylim(-0.6, p - 0.4)
    ax.set_xlim(0, span)
    ax.set_xlabel(f"time ({unit})" if unit else "time")
    shade = " (darker: later chunks)" if v > 1 else ""
    ax.set_title(f"{title} -- bubble {100 * bubble:.1f}%{shade}")
    used = sorted({a.op for _, a, _, _ in recs if a.op.is_compute}, key=list(COLORS).index)
    handles = [Patch(color=COLORS[o], label=LABELS[o]) for o in used]
    if any(a.op.is_comm for _, a, _, _ in recs):
        handles.append(Patch(color=COMM_COLOR, label="communication (and its wait)"))
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.28 - 0.1 / p),
        ncol=len(handles),
        frameon=False,
        fontsize=8,
    )
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return bubble


def draw_schedule(schedule: Schedule, out: str | Path, costs: Any = None) -> float:
    """Simulate ``schedule`` (``costs``: a ``Costs``, default F = 1, B = 2, I = W = 1) and
    draw it; returns the simulated bubble fraction."""
    from plait.parallel.pipeline.simulate import simulate

    sim = simulate(schedule, costs)
    v = f", v={schedule.chunks}" if schedule.chunks > 1 else ""
    title = f"{schedule.name} p={schedule.stages} m={schedule.microbatches}{v}"
    draw_timeline(sim.timeline, out, title, ranks=schedule.stages, chunks=schedule.chunks)
    return float(sim.bubble)
