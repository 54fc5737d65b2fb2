"""The MFU denominator: the CPU matmul peak is measured robustly or reported unknown.

Before issue 14 the CPU peak was the best of five unwarmed 512³ matmuls, so MFU swung
from 9 % to 338 % between identical runs. Now each size gets two untimed warm-up runs,
the median of the timed runs counts, the best size wins, and runs that disagree by more
than ``spread`` times make the peak unknown (MFU then prints ``n/a``).
"""

from __future__ import annotations

import json

import torch

from plait.train.metrics import StepMetrics, measure_peak_flops, peak_flops

CPU = torch.device("cpu")


def test_measured_peak_names_size_threads_and_rate() -> None:
    peak = measure_peak_flops(CPU, sizes=(64, 128), reps=3, spread=float("inf"))
    assert peak.flops is not None and peak.flops > 1e6
    threads = torch.get_num_threads()
    assert peak.source.startswith("measured: fp32 matmul median at ")
    assert f"{threads} thread(s)" in peak.source and "GFLOP/s per rank" in peak.source


def test_unstable_measurement_is_unknown_not_a_number() -> None:
    # spread 1.0: any two timed runs that differ at all (they always do) count as unstable
    peak = measure_peak_flops(CPU, sizes=(64,), reps=3, spread=1.0)
    assert peak.flops is None
    assert peak.source.startswith("unknown:") and "log.peak_tflops" in peak.source


def test_override_wins_and_unknown_mfu_prints_na() -> None:
    peak = peak_flops(CPU, 2.5)
    assert peak.flops == 2.5e12 and peak.source == "log.peak_tflops = 2.5 TFLOP/s"
    m = StepMetrics(1, 2.0, 1e-3, 0.5, 100.0, None, 0.1, 0.0, 0.0)
    assert "mfu n/a" in m.line()
    assert json.loads(json.dumps(m.__dict__))["mfu"] is None
