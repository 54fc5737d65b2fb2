"""The run checks the parallel layer owns (:func:`plait.parallel.checks.validate_run`):
tensor-parallel divisibility, the pipeline schedule, the device's dtypes, after the
config's own checks (``tests/test_config_checks.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.config import Config
from plait.config_io import config_from_dict
from plait.errors import ConfigError
from plait.parallel.checks import validate_run


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
    (
        _cfg(
            parallel={"pp": 2, "pipeline_schedule": "interleaved", "chunks": 2, "microbatches": 3},
            train={"global_batch": 24},
        ),
        2,
        r"the interleaved schedule needs the micro-batches per step to be a multiple of the "
        r"pipeline stages .* got 3 micro-batches for 2 stages; use 2 or 4 micro-batches",
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
