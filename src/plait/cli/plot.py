"""``plait plot RUN.jsonl ...``: compare runs at a glance in one PNG.

Reads the metrics JSONL of one or several runs (what ``plait train`` writes to
``<log.dir>/metrics.jsonl``) and draws five panels against the optimizer step: training
loss, validation loss, the learning rate (the schedule as applied, warm-up and decay:
:mod:`plait.train.lr_schedule`), tokens/s and communication bytes per step, one colour per run,
labelled by its run folder (or ``--label``). Drawn on matplotlib's Agg canvas (no
display, no pyplot state). Bad input -- a missing or empty file, a line that is not a
metrics row -- exits with code 2 naming the file and line.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plait.cli.common import ConfigErrorParser
from plait.errors import ConfigError

PANELS: tuple[tuple[str, str, float], ...] = (
    ("loss", "training loss", 1.0),
    ("val_loss", "validation loss", 1.0),
    ("lr", "learning rate", 1.0),
    ("tokens_per_s", "tokens/s", 1.0),
    ("comm_bytes", "communication (MiB/step)", 2.0**-20),
)
"""(metrics key, panel title, scale applied to the value) of each panel, in order."""


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of one metrics JSONL file (ConfigError naming a bad file or line)."""
    try:
        text = path.read_text("utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read metrics file '{path}': {e.strerror or e}.") from None
    rows: list[dict[str, Any]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n} is not a JSON line ({e.msg}).") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ConfigError(f"{path}:{n} is not a metrics row (no integer 'step').")
        rows.append(row)
    if not rows:
        raise ConfigError(f"metrics file '{path}' holds no rows.")
    return rows


def run_label(path: Path) -> str:
    """A run's name: its folder for ``.../NAME/metrics.jsonl``, else the file's stem."""
    if path.name == "metrics.jsonl" and path.resolve().parent.name:
        return path.resolve().parent.name
    return path.stem


def plot_runs(paths: Sequence[Path], out: Path, labels: Sequence[str] | None = None) -> Path:
    """Draw the runs whose metrics files are ``paths`` into the PNG ``out``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = [read_rows(p) for p in paths]
    names = list(labels) if labels else [run_label(p) for p in paths]
    fig = Figure(figsize=(11, 10), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 2, sharex=True)
    axes.flat[-1].set_visible(False)  # five panels
    for ax, (key, title, scale) in zip(axes.flat, PANELS, strict=False):
        drawn = False
        for rows, name in zip(runs, names, strict=True):
            pts = [
                (r["step"], r[key] * scale) for r in rows if isinstance(r.get(key), (int, float))
            ]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="." if len(pts) < 30 else None, label=name)
                drawn = True
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.ticklabel_format(axis="y", useOffset=False)  # absolute values on the axis
        if not drawn:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
    for ax in (axes[2][0], axes[1][1]):  # the lowest panel of each column
        ax.set_xlabel("step")
        ax.xaxis.set_tick_params(labelbottom=True)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"{len(runs)} run(s): " + ", ".join(names))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def _parser() -> argparse.ArgumentParser:
    p = ConfigErrorParser(
        prog="plait plot",
        description="Draw training loss, validation loss, learning rate, tokens/s and "
        "communication bytes "
        "against the step for one or several runs (their metrics JSONL files) into one PNG.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="metrics files (one per run)")
    p.add_argument("-o", "--out", default="plot.png", help="the PNG to write (default plot.png)")
    p.add_argument(
        "--label", action="append", help="a run's name in the legend (once per run, in order)"
    )
    return p


def plot_main(argv: Sequence[str]) -> int:
    """``plait plot``."""
    ns = _parser().parse_args(list(argv))
    if ns.label and len(ns.label) != len(ns.runs):
        raise ConfigError(f"--label given {len(ns.label)} times for {len(ns.runs)} runs.")
    out = plot_runs([Path(r) for r in ns.runs], Path(ns.out), ns.label)
    print(f"plait: wrote {out} ({len(ns.runs)} run(s))")
    return 0
