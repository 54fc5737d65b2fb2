"""`check_fits`: the verdict the training CLI uses to refuse a layout before it starts."""

from __future__ import annotations

import dataclasses

import pytest

from plait.config import Config, ModelConfig, ParallelConfig, TrainConfig
from plait.plan import check_fits
from plait.plan.fit import cuda_hardware, host_hardware, plan_inputs
from plait.plan.hardware import PRESETS
from plait.plan.modelspec import ModelSpec


def _config(**parallel: int) -> Config:
    return Config(
        model=ModelConfig(vocab_size=256, dim=512, n_layers=8, n_heads=8, max_seq_len=512),
        parallel=ParallelConfig(**parallel),
        train=TrainConfig(global_batch=16, micro_batch=4, seq_len=512),
    )


def test_plan_inputs_follow_the_config() -> None:
    spec, layout, precision, runtime = plan_inputs(_config(dp=2), 2)
    assert spec == ModelSpec.from_config(_config().model, "model")
    assert (layout.dp, layout.micro_batch, layout.micro_batches) == (2, 4, 2)
    assert precision.name == "fp32" and runtime.name == "plait"


def test_the_small_model_fits_this_host() -> None:
    v = check_fits(Config(), 2)
    assert v.fits and v.reasons == ()
    assert "predicted to fit" in v.message()
    assert v.estimate.hardware.name == "cpu-host"


def test_a_config_that_does_not_fit_is_explained_with_fixes() -> None:
    cfg = _config(dp=4)
    need = check_fits(cfg, 4, PRESETS["a100-80gb"]).estimate.memory.total
    small = PRESETS["a100-80gb"].with_memory(need * 0.8)
    v = check_fits(cfg, 4, small, headroom=0.0)
    assert not v.fits
    msg = v.message()
    assert "is predicted not to fit" in msg and "GiB" in msg
    # activations dominate: full recomputation or a smaller micro-batch help
    assert "Predicted to fit with:" in msg and "train.recompute=full" in msg
    tiny = PRESETS["a100-80gb"].with_memory(1e6)
    assert "No single change" in check_fits(cfg, 4, tiny, headroom=0.0).message()


def test_more_ranks_share_the_host_memory() -> None:
    assert host_hardware(4).memory_bytes == pytest.approx(host_hardware(1).memory_bytes / 4)


def test_cuda_device_names_map_to_presets() -> None:
    assert cuda_hardware("NVIDIA H100 80GB HBM3", 85e9).name == "h100-80gb"
    assert cuda_hardware("NVIDIA A100-SXM4-40GB", 42e9).name == "a100-40gb"
    assert cuda_hardware("NVIDIA A100-SXM4-80GB", 85e9).memory_bytes == 85e9


def test_wrong_world_size_is_refused() -> None:
    from plait.errors import ConfigError

    with pytest.raises(ConfigError, match="does not match the world size 3"):
        plan_inputs(dataclasses.replace(_config(dp=2)), 3)
