"""The tensor-parallel block grid (:mod:`plait.bench.tp_block`): measured on real pairs
of ranks, read back exactly by the planner, pooled over runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from plait.bench.tp_block import GRID_KEYS, tp_block_grid_charge, tp_block_scale_points
from plait.plan.hardware import IN_STEP, PRESETS, Curve, Link
from plait.testing import WorkerPool

FACTORS = {(64.0, 256.0): 1.3, (64.0, 2048.0): 0.8, (256.0, 256.0): 1.1, (256.0, 2048.0): 1.0}


def _cpu_like() -> Any:
    link = Link(1e-4, 1e9, (), ((IN_STEP, 2, Curve(((512.0, 1e-3), (2.0**21, 4e-3)))),))
    return dataclasses.replace(
        PRESETS["a100-80gb"],
        op_overhead_s=2e-6,
        block_overhead_s=1e-4,
        intra=link,
        inter=link,
        block_scale=((64.0, 256.0, 2.0),),  # a tp-1 ratio, which the tp grid replaces
    )


@pytest.mark.parametrize("sp", [False, True])
def test_tp_block_scale_reads_back(sp: bool) -> None:
    """With the grid's ratios derived, the planner charges each tensor-parallel grid
    block (compute and collectives) exactly what was measured; the ratios are measured
    over the charge without any grid, whatever grids the profile carries already."""
    hw = _cpu_like()
    bare = dataclasses.replace(hw, block_scale=())
    measured = [(d, t, f * tp_block_grid_charge(bare, d, t, sp)) for (d, t), f in FACTORS.items()]
    points = tp_block_scale_points(hw, measured, sp)
    assert [(d, t) for d, t, _ in points] == list(FACTORS)
    assert [r for _, _, r in points] == pytest.approx(list(FACTORS.values()))
    scaled = dataclasses.replace(hw, **{GRID_KEYS[sp]: points})
    for d, t, sec in measured:
        assert tp_block_grid_charge(scaled, d, t, sp) == pytest.approx(sec)
    again = tp_block_scale_points(scaled, measured, sp)
    assert [r for _, _, r in again] == pytest.approx([r for _, _, r in points])


def test_tp_block_grid_times_plaits_sharded_block(pools: Callable[[int], WorkerPool]) -> None:
    """On two ranks: every grid point is timed, on both clocks, with and without
    sequence parallelism, the same points on both ranks."""
    from plait.bench.measure import BLOCK_GRID_SEQ, CLOCKS

    res = pools(2).run("tests.bench.test_tp_block:_grid_body")
    for r in res:
        for key in GRID_KEYS.values():
            for clock in CLOCKS:
                part = r if clock == "wall" else r["cpu"]
                assert [(d, t) for d, t, _ in part[key]] == [
                    (64.0, BLOCK_GRID_SEQ),
                    (64.0, 2.0 * BLOCK_GRID_SEQ),
                ]
                assert all(sec > 0 for _, _, sec in part[key])


def _grid_body(ctx: Any) -> dict[str, Any]:
    from plait.bench.tp_block import measure_tp_block_grid

    mesh = ctx.mesh(dp=1, tp=2)
    res = {key: measure_tp_block_grid(mesh, sp, 1, (64,), (1, 2)) for sp, key in GRID_KEYS.items()}
    return {
        **{key: r["wall"] for key, r in res.items()},
        "cpu": {key: r["cpu"] for key, r in res.items()},
    }


def test_mean_grids_averages_each_point_on_both_clocks() -> None:
    from plait.bench.tp_block import mean_grids

    def run(sec: float) -> dict[str, Any]:
        pts = [(64.0, 256.0, sec), (64.0, 2048.0, 2 * sec)]
        return {
            "tp_block_scale": pts,
            "sp_block_scale": pts,
            "cpu": {"tp_block_scale": pts, "sp_block_scale": pts},
        }

    got = mean_grids([run(1.0), run(3.0)])
    for part in (got, got["cpu"]):
        for key in GRID_KEYS.values():
            assert part[key] == [(64.0, 256.0, 2.0), (64.0, 2048.0, 4.0)]
    assert mean_grids([{"cpu": {}}, {"cpu": {}}]) == {"cpu": {}}
