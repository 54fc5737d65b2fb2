"""Hardware profiles: curves, TOML round trips, the alpha-beta fit, a real calibration."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plait.bench.calibrate import calibrate, fit_alpha_beta
from plait.cli import main
from plait.errors import ConfigError
from plait.plan.hardware import PRESETS, Curve, Link
from plait.plan.profile_toml import dump_hardware, load_hardware
from plait.testing import WorkerPool


def test_curve_interpolates_log_log_and_clamps() -> None:
    c = Curve(((10.0, 1.0), (1000.0, 100.0)))
    assert c.at(100.0) == pytest.approx(10.0)  # power law between the points
    assert c.at(1.0) == 1.0 and c.at(1e6) == 100.0
    assert Curve.constant(5.0).at(123.0) == 5.0
    with pytest.raises(ConfigError, match="increase strictly"):
        Curve(((2.0, 1.0), (1.0, 1.0)))
    with pytest.raises(ConfigError, match="positive"):
        Curve(((1.0, 0.0),))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fit_recovers_alpha_and_beta(n: int) -> None:
    alpha, bw = 2.5e-4, 1.3e9
    steps, factor = 2.0 * (n - 1), 2.0 * (n - 1) / n
    pts = [(s, steps * alpha + factor * s / bw) for s in (1e3, 1e5, 1e6, 1e7, 1e8)]
    a, b = fit_alpha_beta(pts, steps, factor)
    assert a == pytest.approx(alpha, rel=1e-6)
    assert b == pytest.approx(bw, rel=1e-6)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_toml(tmp_path: Path, name: str) -> None:
    path = tmp_path / "hw.toml"
    path.write_text(dump_hardware(PRESETS[name]), encoding="utf-8")
    assert load_hardware(str(path)) == PRESETS[name]


def test_profile_with_curves_and_fits_round_trips(tmp_path: Path) -> None:
    hw = dataclasses.replace(
        PRESETS["a100-80gb"],
        name='my "cpu"',
        matmul=Curve(((64.0, 1e10), (512.0, 5e10))),
        intra=Link(1e-4, 1e9, (("all_gather", 3e-4, 3e8), ("p2p", 1e-4, 2e9))),
    )
    path = tmp_path / "p.toml"
    path.write_text(dump_hardware(hw, comment="two\nlines"), encoding="utf-8")
    assert load_hardware(str(path)) == hw
    # measured curves, the in-step all-reduce included, survive too
    curve = Curve(((4096.0, 1e-3), (524288.0, 2e-3)))
    hw = dataclasses.replace(
        hw, intra=Link(1e-4, 1e9, (), (("all_reduce", 2, curve), ("all_reduce_in_step", 2, curve)))
    )
    path.write_text(dump_hardware(hw), encoding="utf-8")
    assert load_hardware(str(path)) == hw


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[device\n", "not valid TOML"),
        ("[device]\nname='x'\n", "no [intra] table"),
        ("[device]\n[intra]\n[inter]\n", "needs name"),
    ],
)
def test_bad_profiles_are_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_hardware(str(path))


def test_unknown_key_in_a_profile_is_refused(tmp_path: Path) -> None:
    text = dump_hardware(PRESETS["h200"]).replace("[device]\n", "[device]\nspeed = 3\n")
    path = tmp_path / "bad.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match="unknown key"):
        load_hardware(str(path))


class _Recording:
    """A pool that keeps the per-rank results of its last run."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.results: list[Any] = []

    def run(self, *args: Any, **kwargs: Any) -> list[Any]:
        self.results = self.pool.run(*args, **kwargs)
        return self.results


@pytest.fixture(scope="module")
def calibrated(pools: Callable[[int], WorkerPool]) -> tuple[Any, Any, list[Any], float]:
    """One quick calibration on 2 ranks, shared by the two tests below: ``calibrate``'s
    profile and fits, the ranks' raw results (``calibrate_body``'s), its seconds."""
    pool = _Recording(pools(2))
    t0 = time.perf_counter()
    hw, fits = calibrate(2, quick=True, pool=pool, memory_bytes=4e9)
    return hw, fits, pool.results, time.perf_counter() - t0


def test_calibration_on_two_ranks_feeds_the_planner(
    calibrated: tuple[Any, Any, list[Any], float],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    hw, fits, _, _ = calibrated  # no bound on its seconds: a test times nothing
    assert hw.memory_bytes == 4e9
    assert hw.peak_flops > 1e8 and hw.matmul.peak > 1e8  # any CPU does > 0.1 GFLOP/s
    # the matmul curve is a linear layer in training at sizes (4n·n·n)^(1/3)
    assert [round(s**3 / 4) for s, _ in hw.matmul.points] == [n**3 for n in (32, 64, 128, 256)]
    # attention from sequence 32: ring attention's chunks at cp = 2, s = 128
    assert [s for s, _ in hw.attention.points] == [32.0, 64.0, 128.0, 256.0]
    assert {f.op for f in fits} == {"all_reduce", "all_gather", "reduce_scatter", "p2p"}
    for f in fits:
        assert f.alpha >= 0 and f.bandwidth > 0
        assert hw.intra.fit(f.op) == (f.alpha, f.bandwidth)
    assert 0 < hw.op_overhead_s < 1e-2 and hw.optimizer_bandwidth > 0
    # the in-step all-reduce (interleaved with compute, no barrier) on pairs of ranks
    (in_step,) = [(n, c) for op, n, c in hw.intra.measured if op == "all_reduce_in_step"]
    assert in_step[0] == 2
    assert [s for s, _ in in_step[1].points] == [2.0**9, 2.0**19]
    assert all(t > 0 for _, t in in_step[1].points)
    path = tmp_path / "cpu.toml"
    path.write_text(dump_hardware(hw), encoding="utf-8")
    assert load_hardware(str(path)) == hw
    code = main(["plan", "--model", "small", "--hardware", str(path), "--devices", "2",
                 "--seq", "128", "--global-batch", "16", "--json"])  # fmt: skip
    assert code == 0
    assert '"fits": true' in capsys.readouterr().out


def test_cpu_time_profile(calibrated: tuple[Any, Any, list[Any], float]) -> None:
    """From the same ranks' results as the test above (``calibrate_body``, quick)."""
    from plait.bench.calibrate import profile_from_results

    results = calibrated[2]
    wall, _ = profile_from_results(results, 4e9)
    cpu, fits = profile_from_results(results, 4e9, clock="cpu")
    assert "CPU time" in cpu.source and "wall clock" in wall.source
    assert cpu.matmul.points != wall.matmul.points  # two clocks, two sets of rates
    assert [s for s, _ in cpu.matmul.points] == [s for s, _ in wall.matmul.points]
    assert cpu.peak_flops > 1e8 and cpu.op_overhead_s > 0
    assert {f.op for f in fits} == {"all_reduce", "all_gather", "reduce_scatter", "p2p"}
    with pytest.raises(ValueError, match="unknown clock"):
        profile_from_results(results, 4e9, clock="sundial")
    # the fixed costs read back: with the derived overheads the planner charges the tiny
    # block and the tiny ring exactly what the ranks measured (when above the rates)
    import statistics

    from plait.bench.calibrate import ring_charge
    from plait.bench.compute_profile import tiny_block_charge

    for clock, hw in (("wall", wall), ("cpu", cpu)):
        part = [r["compute"] if clock == "wall" else r["compute"]["cpu"] for r in results]
        tiny = statistics.median(c["tiny_block"] for c in part)
        # (the overhead is derived before the grid's ratio, so without it)
        unscaled = dataclasses.replace(hw, block_scale=())
        assert tiny_block_charge(unscaled) == pytest.approx(max(tiny, tiny_block_charge(
            dataclasses.replace(unscaled, block_overhead_s=0.0))))  # fmt: skip
        # the block grid (one point when quick): charged exactly its median measurement
        from plait.bench.compute_profile import block_grid_charge

        ((d, t, _),) = part[0]["block_grid"]
        grid = statistics.median(c["block_grid"][0][2] for c in part)
        assert [(d, t)] == [p[:2] for p in hw.block_scale]
        assert block_grid_charge(hw, d, t) == pytest.approx(grid)
        ring = max(r["ring"][clock] for r in results)
        assert ring_charge(hw) == pytest.approx(
            max(ring, ring_charge(dataclasses.replace(hw, ring_overhead_s=0.0)))
        )
        # the pipeline's per-action cost: the slowest rank's solution of its tiny step
        from plait.bench.calibrate_pipeline import extra_per_microbatch, pipeline_comm_charge

        per_mb, loss = pipeline_comm_charge(hw)
        got = [extra_per_microbatch(r["pipeline"][clock]["pipeline"],
                                    r["pipeline"][clock]["plain"], per_mb, loss, clock)
               for r in results]  # fmt: skip
        assert hw.pp_action_overhead_s == pytest.approx(max(0.0, max(got) / 2))
        assert hw.pp_action_per_work == 0.0  # quick: the tiny pipeline only
        assert all(r["pipeline"][clock]["pipeline"] > 0 for r in results)
        # the tensor-parallel block grids (one point each when quick): the planner
        # charges each the slowest rank's median measurement
        from plait.bench.tp_block import GRID_KEYS, tp_block_grid_charge

        for sp, key in GRID_KEYS.items():
            pts = [r["tp_grid"][key] if clock == "wall" else r["tp_grid"]["cpu"][key]
                   for r in results]  # fmt: skip
            ((d, t, _),) = pts[0]
            assert [(d, t)] == [p[:2] for p in getattr(hw, key)]
            slowest = max(p[0][2] for p in pts)
            assert tp_block_grid_charge(hw, d, t, sp) == pytest.approx(slowest)


def test_pipeline_extra_per_microbatch_by_hand() -> None:
    """t_pipeline = n·(t_plain/m + c + y) + t_loss, m = 4 (n = 5 on the wall clock): the
    extra y per micro-batch is solved back on both clocks (y = 2·x without work term)."""
    from plait.bench.calibrate_pipeline import (
        TINY_PP_MICRO,
        extra_per_microbatch,
        solve_action_costs,
    )

    assert TINY_PP_MICRO == 4
    x, plain, c, loss = 3e-4, 8e-3, 1e-4, 5e-4
    cpu = 4 * (plain / 4 + c + 2 * x) + loss
    wall = 5 * (plain / 4 + c + 2 * x) + loss
    assert extra_per_microbatch(cpu, plain, c, loss, "cpu") == pytest.approx(2 * x)
    assert extra_per_microbatch(wall, plain, c, loss, "wall") == pytest.approx(2 * x)
    # a pipeline no slower than its pieces run plainly: no overhead, never negative
    y = extra_per_microbatch(plain, plain, c, loss, "cpu")
    assert y < 0 and solve_action_costs((plain / 4, y), None) == (0.0, 0.0)


def test_pipeline_action_costs_solved_by_hand() -> None:
    """Two pipelines' extra seconds per micro-batch, y = 2·x + k·W, give x and k; a line
    through both that would make x negative keeps x = 0; one pipeline gives k = 0."""
    from plait.bench.calibrate_pipeline import solve_action_costs

    x, k = 1.5e-4, 0.12
    tiny, work = (6e-4, 2 * x + k * 6e-4), (1.1e-2, 2 * x + k * 1.1e-2)
    assert solve_action_costs(tiny, work) == pytest.approx((x, k))
    assert solve_action_costs(tiny, None) == pytest.approx((x + k * 6e-4 / 2, 0.0))
    # work cheaper per micro-batch than the tiny pipeline: no work term
    assert solve_action_costs((6e-4, 1e-3), (1.1e-2, 5e-4)) == pytest.approx((5e-4, 0.0))
    # steeper than through the origin: x = 0, k from the pipeline with work alone
    assert solve_action_costs((6e-4, 1e-5), (1.1e-2, 2.2e-3)) == pytest.approx((0.0, 0.2))
    assert solve_action_costs((6e-4, -1e-3), None) == (0.0, 0.0)
