"""``plait bench calibrate --device cuda``: the device measurement (run tiny on CPU here),
its profile read back, the block overhead read back, and the refusal without a GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from plait.bench.compute_profile import block_overhead, tiny_block_charge
from plait.bench.device import calibrate_cuda, device_profile, measure_device
from plait.cli import main
from plait.plan.compute import Gemm
from plait.plan.hardware import PRESETS
from plait.plan.profile_toml import dump_hardware, load_hardware


def test_device_measurement_reads_back(tmp_path: Path) -> None:
    rates = measure_device(
        "cpu", torch.float32, linear=(32, 64), attention=(32, 64), elementwise=(2**12, 2**14),
        reps=3, optimizer_params=2**12,
    )  # fmt: skip
    assert len(rates.matmul.points) == 2 and rates.launch_s > 0 and rates.tiny_block_s > 0
    hw = device_profile(PRESETS["h100-80gb"], rates, "test")
    path = tmp_path / "gpu.toml"
    path.write_text(dump_hardware(hw), encoding="utf-8")
    back = load_hardware(str(path))
    assert back == hw
    # the planner charges a measured linear layer's three GEMMs exactly the measured time
    for size, rate in rates.matmul.points:
        g = Gemm("x", size, size, size)
        assert 3 * g.seconds(back) == pytest.approx(3 * g.flops / rate)
    assert back.peak_flops == PRESETS["h100-80gb"].peak_flops  # MFU against the datasheet
    assert back.op_overhead_s == 0.0 and back.block_overhead_s == 0.0


def test_block_overhead_reads_back() -> None:
    """The planner's charge for the tiny block, with the overhead calibration derived,
    equals what was measured."""
    hw = dataclasses.replace(PRESETS["a100-80gb"], op_overhead_s=2e-6)
    measured = tiny_block_charge(hw) + 7e-4
    over = block_overhead(hw, measured)
    assert over == pytest.approx(7e-4)
    assert tiny_block_charge(dataclasses.replace(hw, block_overhead_s=over)) == pytest.approx(
        measured
    )
    assert block_overhead(hw, 0.0) == 0.0  # never negative


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_cuda_calibration_refused_without_a_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gpu.toml"
    assert main(["bench", "calibrate", "--device", "cuda", "--out", str(out)]) == 2
    assert "no CUDA device" in capsys.readouterr().err and not out.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_calibration_on_the_gpu(tmp_path: Path) -> None:
    hw, rates = calibrate_cuda(quick=True)
    assert rates.launch_s > 0
    assert hw.matmul.peak > 1e13 and hw.attention.peak > 1e12  # bf16 on a data-centre GPU
    assert hw.memory_bytes == pytest.approx(torch.cuda.get_device_properties(0).total_memory)
    out = tmp_path / "gpu.toml"
    assert main(["bench", "calibrate", "--device", "cuda", "--quick", "--out", str(out)]) == 0
    assert load_hardware(str(out)).name == hw.name


def test_ring_overhead_reads_back() -> None:
    """The planner's charge for the tiny ring, with the derived ring overhead, equals
    what was measured; the charge grows by exactly that overhead."""
    from plait.bench.calibrate import ring_charge, ring_overhead

    hw = dataclasses.replace(PRESETS["a100-80gb"], op_overhead_s=2e-6)
    measured = ring_charge(hw) + 2e-3
    over = ring_overhead(hw, measured)
    assert over == pytest.approx(2e-3)
    assert ring_charge(dataclasses.replace(hw, ring_overhead_s=over)) == pytest.approx(measured)


def test_block_scale_reads_back() -> None:
    """With the grid's ratios derived, the planner charges each grid block exactly what
    was measured, and the ratios are measured / charged without a scale."""
    from plait.bench.compute_profile import block_grid_charge, block_scale_points

    hw = dataclasses.replace(PRESETS["a100-80gb"], op_overhead_s=2e-6, block_overhead_s=1e-4)
    factors = {(64.0, 256.0): 1.3, (64.0, 2048.0): 0.8, (256.0, 256.0): 1.1, (256.0, 2048.0): 1.0}
    measured = [(d, t, f * block_grid_charge(hw, d, t)) for (d, t), f in factors.items()]
    points = block_scale_points(hw, measured)
    assert [(d, t) for d, t, _ in points] == list(factors)
    assert [r for _, _, r in points] == pytest.approx(list(factors.values()))
    scaled = dataclasses.replace(hw, block_scale=points)
    for d, t, sec in measured:
        assert block_grid_charge(scaled, d, t) == pytest.approx(sec)
    # the ratio is taken against the unscaled charge, whatever scale hw carries already
    again = block_scale_points(scaled, measured)
    assert [r for _, _, r in again] == pytest.approx([r for _, _, r in points])


def test_block_grid_measurement_is_plaits_block() -> None:
    """The grid measurement times plait's block at the grid's shapes on both clocks."""
    from plait.bench.measure import BLOCK_GRID_SEQ, CLOCKS, measure_block_grid

    got = measure_block_grid(1, dims=(16,), batches=(1, 2))
    assert set(got) == set(CLOCKS)
    for clock in CLOCKS:
        assert [(d, t) for d, t, _ in got[clock]] == [
            (16.0, BLOCK_GRID_SEQ),
            (16.0, 2.0 * BLOCK_GRID_SEQ),
        ]
        assert all(sec > 0 for _, _, sec in got[clock])
