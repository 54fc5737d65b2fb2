"""Young's checkpoint interval sqrt(2 C M) and Daly's refinement, against the formulas
worked by hand."""

from __future__ import annotations

import math

import pytest

from plait.plan.checkpoint_interval import Interval, daly_interval_s, young_interval_s


def test_young_by_hand() -> None:
    # C = 2 s, M = 24 h: sqrt(2 * 2 * 86400) = sqrt(345600) = 587.88 s
    assert young_interval_s(2.0, 86400.0) == pytest.approx(587.8775, abs=1e-4)
    iv = Interval("disk", 2.0, 86400.0, step_s=0.5)
    assert iv.steps == 1176  # 587.88 / 0.5 = 1175.8 -> 1176
    assert iv.lost_s == pytest.approx(294.0)  # half the interval, in steps of 0.5 s
    assert "disk checkpoints every 1176 steps" in iv.line()
    assert Interval("memory", 1e-6, 1.0, step_s=10.0).steps == 1  # never below one step


def test_daly_by_hand() -> None:
    c, m = 2.0, 86400.0
    r = c / (2 * m)
    want = math.sqrt(2 * c * m) * (1 + math.sqrt(r) / 3 + r / 9) - c
    assert daly_interval_s(c, m) == pytest.approx(want, rel=1e-12)
    assert abs(daly_interval_s(c, m) / young_interval_s(c, m) - 1) < 0.01  # C << M
    assert daly_interval_s(5.0, 2.0) == 2.0  # C >= 2M: checkpoint every M
