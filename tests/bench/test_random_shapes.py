"""The random shapes of ``planner_vs_measured.py --shapes`` (issue 46): never a calibration
point, off the block grid's range, runnable by every layout row, the same per seed; and the
error distribution the benchmark prints from them."""

from __future__ import annotations

import math

import pytest

from plait.bench import calibrate, calibrate_pipeline, measure
from plait.bench.error_summary import ALL, Cell, cells_table, summarize, summary_table
from plait.bench.planner_rows import ROWS, available, rows_at
from plait.bench.random_shapes import (
    Shape,
    acceptable,
    calibration_hits,
    calibration_points,
    draw_shapes,
)

SEEDS = range(200)


def _measured_values() -> dict[str, set[int]]:
    """Each coordinate's values in the calibration, read here from the measurement
    constants themselves (not through ``calibration_points``)."""
    tiny, work = measure.TINY_BLOCK, calibrate_pipeline.WORK_PP_MODEL
    b, h, s, d = calibrate.TINY_RING
    return {
        "hidden": {*measure.BLOCK_GRID_DIMS, tiny["dim"], work["dim"], h * d},
        "head_dim": {measure.ATTN_HEAD_DIM, tiny["dim"] // tiny["n_heads"], d},
        "seq": {*measure.ATTENTION_SEQS, measure.BLOCK_GRID_SEQ, tiny["max_seq_len"], s},
        "micro_batch": {
            *measure.BLOCK_GRID_BATCHES,
            measure.ATTN_BATCH,
            measure.TINY_BATCH,
            calibrate_pipeline.WORK_PP_BATCH,
            b,
        },
        "tokens": {n * measure.BLOCK_GRID_SEQ for n in measure.BLOCK_GRID_BATCHES},
    }


def test_never_a_calibration_point_and_always_off_the_grid() -> None:
    seen = _measured_values()
    dims, batches = measure.BLOCK_GRID_DIMS, measure.BLOCK_GRID_BATCHES
    tok_lo, tok_hi = (n * measure.BLOCK_GRID_SEQ for n in (min(batches), max(batches)))
    for seed in SEEDS:
        for sh in draw_shapes(5, seed):
            assert sh.hidden not in seen["hidden"] and not math.log2(sh.hidden).is_integer()
            assert sh.head_dim not in seen["head_dim"]
            assert sh.seq not in seen["seq"] and sh.seq // 4 not in seen["seq"]  # ring chunk
            assert sh.micro_batch not in seen["micro_batch"]
            assert sh.tokens not in seen["tokens"] and sh.tokens // 2 not in seen["tokens"]
            assert not min(dims) <= sh.hidden <= max(dims) or not tok_lo <= sh.tokens <= tok_hi
            assert 40 <= sh.hidden <= 400 and 16 <= sh.head_dim <= 48
            assert 64 <= sh.seq <= 320 and 1 <= sh.micro_batch <= 8 and 2 <= sh.layers <= 6


def test_calibration_points_hold_every_measured_value() -> None:
    points = calibration_points()
    for coord, values in _measured_values().items():
        assert values <= getattr(points, coord), coord


def test_a_calibration_point_is_refused() -> None:
    points = calibration_points()
    # the benchmark's fixed block: hidden 128, head dim 32, sequence 128, 8 sequences
    fixed = Shape(hidden=128, heads=4, head_dim=32, layers=4, seq=128, micro_batch=8)
    assert set(calibration_hits(fixed, points)) >= {"hidden", "head_dim", "seq", "micro_batch"}
    assert not acceptable(fixed, points)
    # no calibration value, but inside the grid's range in hidden size and tokens
    inside = Shape(hidden=132, heads=6, head_dim=22, layers=3, seq=196, micro_batch=3)
    assert calibration_hits(inside, points) == []
    assert not acceptable(inside, points)
    # the same with tokens per micro-batch (3 x 68 = 204) below the grid: accepted
    assert acceptable(Shape(132, 6, 22, 3, 68, 3), points)


def test_the_same_shapes_for_the_same_seed() -> None:
    assert draw_shapes(5, 7) == draw_shapes(5, 7)
    assert draw_shapes(5, 7) != draw_shapes(5, 8)
    assert draw_shapes(5, 7)[:2] == draw_shapes(2, 7)
    with pytest.raises(ValueError, match="at least 1"):
        draw_shapes(0, 0)


def test_every_layout_row_runs_every_shape() -> None:
    """The runtime's own validation (``validate_run``) accepts each of the nine layouts
    on each shape, with the fixed rows' micro-batches per step and data-parallel rank."""
    for seed in range(10):
        for sh in draw_shapes(3, seed):
            for fixed, row in zip(ROWS, rows_at(sh), strict=True):
                assert available(row) is None, (sh, row.name, available(row))
                assert row.micro_batch == sh.micro_batch and row.seq == sh.seq
                assert row.config()["model"]["dim"] == sh.hidden
                per_step = fixed.global_batch // fixed.micro_batch
                assert row.global_batch == per_step * sh.micro_batch


def test_error_distribution_per_layout() -> None:
    cells = [
        Cell("dp1", "a", -0.05),
        Cell("dp1", "b", 0.25),
        Cell("dp1", "c", -0.10),
        Cell("tp2", "a", -0.30),
    ]
    dp1, tp2, every = summarize(cells)
    assert (dp1.layout, dp1.cells, dp1.within) == ("dp1", 3, 2)
    assert dp1.median_abs == pytest.approx(0.10) and dp1.worst == pytest.approx(0.25)
    assert tp2.worst == pytest.approx(-0.30) and tp2.within == 0
    assert every.layout == ALL and every.cells == 4 and every.within == 2
    assert every.median_abs == pytest.approx(0.175)  # median of 0.05, 0.10, 0.25, 0.30
    table = summary_table(cells, "CPU")
    assert "| dp1 | 3 | 10.0% | +25.0% | 2/3 |" in table
    grid = cells_table(cells)
    assert grid[0] == "| shape | dp1 | tp2 |"
    assert "| b | +25.0% |  |" in grid  # tp2 not measured on b
