"""Gantt charts of pipeline timelines: the PNG is written, non-trivial, and coloured."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from matplotlib import image

from plait.errors import ConfigError
from plait.parallel.pipeline.actions import Action, Op
from plait.parallel.pipeline.schedules import build_schedule
from plait.parallel.pipeline.simulate import simulate
from plait.viz import COLORS, _shade, as_records, bubble_fraction, draw_schedule, draw_timeline


def rgb(color: str | tuple[float, float, float]) -> np.ndarray:
    if isinstance(color, str):
        h = color.lstrip("#")
        return np.array([int(h[k : k + 2], 16) / 255 for k in (0, 2, 4)])
    return np.array(color)


def share(img: np.ndarray, color: np.ndarray) -> float:
    """Fraction of pixels within 2/255 of ``color``."""
    return float((np.abs(img[..., :3] - color).max(axis=-1) < 2.5 / 255).mean())


def test_1f1b_png_is_written_with_distinct_colours(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "1f1b.png"
    bubble = draw_schedule(build_schedule("1f1b", 4, 8), out)
    assert bubble == pytest.approx(3 / 11)
    assert out.stat().st_size > 10_000
    img = image.imread(out)
    h, w = img.shape[:2]
    assert h > 200 and w > 600
    assert share(img, rgb(COLORS[Op.FORWARD])) > 0.01
    assert share(img, rgb(COLORS[Op.BACKWARD])) > 0.02  # backward is twice as long
    assert share(img, rgb(COLORS[Op.BACKWARD_WEIGHT])) == 0.0
    assert share(img, np.ones(3)) > 0.3  # the white background and idle time
    colours = {tuple(c) for c in (img[..., :3] * 255).round().reshape(-1, 3).tolist()}
    assert len(colours) > 20


def test_zero_bubble_and_interleaved_colours(tmp_path: Path) -> None:
    assert draw_schedule(build_schedule("zb", 4, 8), tmp_path / "zb.png") == pytest.approx(1 / 9)
    zb = image.imread(tmp_path / "zb.png")
    for op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
        assert share(zb, rgb(COLORS[op])) > 0.01, op
    assert share(zb, rgb(COLORS[Op.BACKWARD])) == 0.0
    draw_schedule(build_schedule("interleaved", 4, 8, 2), tmp_path / "il.png")
    il = image.imread(tmp_path / "il.png")
    for chunk in (0, 1):  # each chunk in its own shade
        assert share(il, rgb(_shade(COLORS[Op.FORWARD], chunk, 2))) > 0.005, chunk


def test_measured_records_draw_the_same_way(tmp_path: Path) -> None:
    # records as the runtime writes them: plain tuples with float seconds
    sim = simulate(build_schedule("gpipe", 2, 2))
    measured = [(e.rank, e.action, 0.01 * float(e.start) + 5.0, 0.01 * float(e.end) + 5.0)
                for e in sim.timeline]
    b = draw_timeline(measured, tmp_path / "m.png", "measured", unit="s")
    assert b == pytest.approx(float(sim.bubble))
    assert (tmp_path / "m.png").stat().st_size > 5_000
    assert as_records(sim.timeline)[0] == (0, sim.timeline[0].action, 0.0, 1.0)


def test_bubble_fraction_of_a_hand_made_timeline() -> None:
    f, b = Action(Op.FORWARD, 0, 0), Action(Op.BACKWARD, 0, 1)
    recs = [(0, f, 0.0, 1.0), (1, b, 1.0, 2.0), (0, Action(Op.SEND_ACT, 0, 0), 1.0, 1.5)]
    assert bubble_fraction(recs) == pytest.approx(0.5)


def test_bad_timelines_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no records"):
        draw_timeline([], tmp_path / "x.png")
    with pytest.raises(ConfigError, match="not an Action"):
        draw_timeline([(0, "F0", 0.0, 1.0)], tmp_path / "x.png")
