"""The run checks the parallel layer owns (:func:`plait.parallel.checks.validate_run`):
tensor-parallel divisibility, the pipeline schedule, the device's dtypes, after the
config's own checks (``tests/config/test_rules.py``)."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.config import Config
from plait.config.coerce import config_from_dict
from plait.errors import ConfigError
from plait.parallel.checks import carry_validation, is_validated, validate_run


def _cfg(**sections: dict[str, Any]) -> Config:
    return config_from_dict(sections)


PARALLEL_OWNED: list[tuple[Config, int, str]] = [
    (
        _cfg(parallel={"tp": 4}, model={"n_heads": 2, "dim": 32}),
        4,
        r"model\.n_heads: 2 heads are not divisible by the tensor-parallel degree tp=4; "
        r"choose tp among the divisors of 2: \[1, 2\]",
    ),
    (
        _cfg(parallel={"tp": 4}, model={"n_heads": 8, "n_kv_heads": 2, "ffn_dim": 90}),
        4,
        r"model\.ffn_dim: 90 features are not divisible by .* tp=4; .* \[1, 2, 3, 5, 6, 9",
    ),
    (
        _cfg(parallel={"tp": 2}, model={"dim": 48, "n_heads": 6, "n_kv_heads": 3}),
        2,
        r"model\.n_kv_heads: 3 key/value heads cannot be split over tp=2",
    ),
    (
        _cfg(parallel={"tp": 4, "sequence_parallel": True}, train={"seq_len": 30}),
        4,
        r"sequence length 30 is not divisible by 4; use a multiple of 4 \(e\.g\. 28 or 32\)",
    ),
]
"""Runs the config layer accepts and the parallel layer refuses, with the refusal."""


@pytest.mark.parametrize(("cfg", "world", "pattern"), PARALLEL_OWNED)
def test_validate_run_refuses_what_the_parallel_layer_cannot_run(
    cfg: Config, world: int, pattern: str
) -> None:
    cfg.validate(world)  # the config layer has no objection: the check lives here
    with pytest.raises(ConfigError, match=pattern):
        validate_run(cfg, world)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_validate_run_checks_the_device_supports_the_dtype() -> None:
    cfg = _cfg(precision={"dtype": "bf16"}, launch={"device": "cuda"})
    cfg.validate(1)
    with pytest.raises(ConfigError, match=r"precision\.dtype = 'bf16' cannot run here: .*CUDA"):
        validate_run(cfg, 1)


def test_validate_run_runs_the_config_checks_first() -> None:
    with pytest.raises(ConfigError, match=r"dp=3 x tp=1 x pp=1 x cp=1 = 3 ranks does not match"):
        validate_run(_cfg(parallel={"dp": 3}), 2)
    # a run wrong in both ways is refused for the config's reason (heads 2 with tp 4 as well)
    both = _cfg(parallel={"tp": 4}, model={"n_heads": 2, "dim": 32}, train={"seq_len": 300})
    with pytest.raises(ConfigError, match=r"train\.seq_len \(300\) exceeds model\.max_seq_len"):
        validate_run(both, 4)


def test_validate_run_passes() -> None:
    validate_run(Config(), 2)
    validate_run(Config(), 1)
    validate_run(_cfg(parallel={"zero": 3, "offload": "params"}, train={"recompute": "full"}), 2)
    validate_run(_cfg(parallel={"zero_shard_size": 1}, precision={"dtype": "bf16"}), 2)
    validate_run(_cfg(model={"vocab_size": 100}, data={"tokenizer": "tiktoken:x"}), 1)
    validate_run(_cfg(train={"seq_len": 256}), 4)
    validate_run(_cfg(parallel={"tp": 2, "sequence_parallel": True, "zero": 3}), 4)  # dp2 x tp2
    validate_run(_cfg(parallel={"tp": 4}, model={"vocab_size": 257, "n_kv_heads": 2}), 4)  # padded
    validate_run(_cfg(parallel={"pp": 2, "pipeline_schedule": "interleaved", "chunks": 2}), 2)


# ----------------------------------------------------------------------------- once per process


def _count_validations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The world sizes of every :meth:`Config.validate` call from now on."""
    calls: list[int] = []
    real = Config.validate

    def counted(self: Config, world_size: int) -> None:
        calls.append(world_size)
        real(self, world_size)

    monkeypatch.setattr(Config, "validate", counted)
    return calls


def test_validate_run_checks_a_config_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_validations(monkeypatch)
    cfg = _cfg(parallel={"dp": 2})
    assert not is_validated(cfg, 2)
    validate_run(cfg, 2)
    validate_run(cfg, 2)  # the trainer's call after the launcher's: nothing again
    assert calls == [2] and is_validated(cfg, 2)
    received = pickle.loads(pickle.dumps(cfg))  # how a Ray rank receives it
    validate_run(received, 2)
    assert calls == [2] and is_validated(received, 2)
    assert not is_validated(cfg, 4)  # for another world it is not validated
    assert not is_validated(_cfg(parallel={"dp": 2}), 2)  # an equal config was not checked
    cfg.train.steps = 7  # a changed value voids the mark
    assert not is_validated(cfg, 2)
    validate_run(cfg, 2)
    assert calls == [2, 2]


def test_a_refused_config_is_not_marked() -> None:
    cfg = _cfg(parallel={"dp": 3})
    for _ in range(2):  # refused every time, not only the first
        with pytest.raises(ConfigError, match="does not match"):
            validate_run(cfg, 2)
    assert not is_validated(cfg, 2)


def test_the_ray_drivers_copies_keep_the_mark(tmp_path: Path) -> None:
    from plait.launch.ray_backend import absolute_paths

    cfg = _cfg(train={"checkpoint_dir": "ck"})
    assert not is_validated(absolute_paths(cfg, tmp_path), 1)  # nothing to keep yet
    validate_run(cfg, 1)
    fixed = absolute_paths(cfg, tmp_path)
    assert fixed.train.checkpoint_dir == str(tmp_path / "ck") and is_validated(fixed, 1)
    resumed = carry_validation(cfg, dataclasses.replace(cfg, train=fixed.train))
    assert is_validated(resumed, 1)
    cfg.parallel.zero = 1  # a config changed after validation passes no mark on
    assert not is_validated(carry_validation(cfg, dataclasses.replace(cfg)), 1)


def test_one_validation_in_a_one_process_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`plait train` validates, then the trainer asks again: the config is checked once."""
    from plait.cli import main
    from tests.tiny import tiny_args

    calls = _count_validations(monkeypatch)
    out = tmp_path / "m.jsonl"
    assert main(["train", *tiny_args(), "--nproc", "1", "--steps", "1", "--metrics", str(out)]) == 0
    assert "step" in capsys.readouterr().out
    assert calls == [1]


def test_the_parallel_layer_uses_the_configs_value_sets() -> None:
    """The sets plait.config declares are the ones the parallel constructors take."""
    import typing

    from plait import config
    from plait.config import choices
    from plait.optim import Optimizer
    from plait.parallel import compression, precision
    from plait.parallel.pipeline import schedules
    from plait.parallel.pipeline import zero as pipeline_zero
    from plait.parallel.recompute import apply_recompute
    from plait.parallel.zero import wrapper

    assert wrapper.Offload is config.Offload
    assert pipeline_zero.GradReduce is config.PPGradReduce
    assert typing.get_type_hints(apply_recompute)["mode"] is config.Recompute
    assert typing.get_type_hints(Optimizer.__init__)["nonfinite"] is config.NonFinite
    assert compression.METHODS is config.COMPRESSIONS
    assert schedules.SCHEDULES is config.PIPELINE_SCHEDULES
    assert tuple(precision.DTYPES) == typing.get_args(choices.DType)  # names -> torch dtypes
