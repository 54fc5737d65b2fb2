"""The planner's compression model against the runtime and against itself.

* PowerSGD's wire elements in the planner (from the model's shape alone) equal what the
  runtime compressor sends for the built-in model's actual parameters (``small`` and
  ``tiny`` presets), at tp 1 and tp 2.
* Top-k and the casts move the bytes their formulas say.
* Compression pays on slow links between nodes and not inside one NVLink node.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plait.config import ModelConfig
from plait.config.presets import MODEL_PRESETS
from plait.errors import ConfigError
from plait.model import Transformer
from plait.parallel.compression import PowerSGDCompressor
from plait.plan.compression import powersgd_elements, traffic
from plait.plan.estimate import step_time
from plait.plan.hardware import Link, hardware_preset
from plait.plan.layout import PRECISIONS, RUNTIMES, Layout
from plait.plan.modelspec import MODEL_SPECS
from tests.plan.queries import query


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("rank", [1, 4])
def test_powersgd_elements_match_the_runtime(preset: str, rank: int) -> None:
    cfg: ModelConfig = MODEL_PRESETS[preset]
    shapes = [p.shape for p in Transformer(cfg).parameters()]
    want = PowerSGDCompressor(rank).wire_elements(shapes)
    sent, plain, _ = powersgd_elements(MODEL_SPECS[preset], 1, rank)
    assert (sent, plain) == want


def test_powersgd_elements_under_tensor_parallelism() -> None:
    """tp 2 halves the split dimension of each matrix, so every compressed matrix
    sends (m/2 + n) r or (m + n/2) r: fewer elements than at tp 1, more than half."""
    spec = MODEL_SPECS["small"]
    sent1, _, _ = powersgd_elements(spec, 1, 4)
    sent2, _, _ = powersgd_elements(spec, 2, 4)
    assert sent1 / 2 < sent2 < sent1


def test_traffic_formulas() -> None:
    spec, hw = MODEL_SPECS["small"], hardware_preset("a100-80gb")
    p = 1000
    assert traffic(spec, hw, "bf16", p, 4, 8, 1, 0.01, 4).wire_bytes == 2 * p
    t = traffic(spec, hw, "topk", p, 4, 8, 1, 0.01, 4)
    assert (t.op, t.wire_bytes, t.overlapped) == ("all_gather", 8 * 10 * (4 + 4), False)
    assert traffic(spec, hw, "none", p, 4, 8, 1, 0.01, 4).wire_bytes == 4 * p


def _step_ms(method: str, gbit: float) -> float:
    hw0 = hardware_preset("a100-80gb")
    if gbit:
        link = Link(latency_s=20e-6, bandwidth=gbit * 1e9 / 8)
        hw = dataclasses.replace(hw0, devices_per_node=1, inter=link)
    else:
        hw = hw0
    spec = MODEL_SPECS["gpt2-1.5b"]
    lay = Layout(dp=8, compression=method)
    return (
        step_time(query(spec, lay, PRECISIONS["fp32"], RUNTIMES["plait"], 1024, hw), lay).total
        * 1e3
    )


def test_compression_pays_on_slow_links_only() -> None:
    for method in ("bf16", "topk", "powersgd"):
        assert _step_ms(method, 1) < 0.6 * _step_ms("none", 1), method
    for method in ("topk", "powersgd"):  # inside one NVLink node the work costs more
        assert _step_ms(method, 0) > _step_ms("none", 0), method


def test_layout_refuses_compression_with_zero() -> None:
    with pytest.raises(ConfigError, match="zero 0"):
        Layout(dp=2, zero=1, compression="topk")
    with pytest.raises(ConfigError, match="compression must be"):
        Layout(dp=2, compression="zip")
    assert torch.__version__  # this test module may import torch (the planner does not)
