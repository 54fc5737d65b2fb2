"""`check_fits`: the verdict the training CLI uses to refuse a layout before it starts."""

from __future__ import annotations

import dataclasses

import pytest

from plait.cli import main
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
    assert (layout.dp, layout.micro_batch, layout.microbatches) == (2, 4, 2)
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


TINY = [
    "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
    "--model.max_seq_len", "32", "--seq-len", "32", "--global-batch", "8",
    "--data.max_bytes", "200000", "--train.eval_every", "0", "--train.eval_batches", "1",
    "--progress", "none", "--log.peak_tflops", "1", "--nproc", "1", "--steps", "1",
    "--device", "cpu",
]  # fmt: skip


def test_plait_train_refuses_a_layout_predicted_not_to_fit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import plait.plan.fit as fit

    # this host: the tiny model fits, the check passes and training runs
    assert main(["train", *TINY]) == 0
    capsys.readouterr()
    # a host with 100 kB of RAM: refused before anything starts, with the numbers
    real = fit.host_hardware
    monkeypatch.setattr(fit, "host_hardware", lambda ranks: real(ranks).with_memory(1e5))
    assert main(["train", *TINY]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert "is predicted not to fit" in out.err and "cpu-host has 0.0 GiB usable" in out.err
    assert "--launch.check_memory false" in out.err and out.err.count("\n") == 1
    # the override starts it anyway
    assert main(["train", *TINY, "--launch.check_memory", "false"]) == 0


def test_device_hardware_on_this_machine() -> None:
    from plait.plan.fit import device_hardware

    assert device_hardware("cpu", 2).name == "cpu-host"
    assert device_hardware("cpu", 2).memory_bytes == host_hardware(2).memory_bytes
