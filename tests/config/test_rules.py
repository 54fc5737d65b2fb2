"""The rules of :mod:`plait.config.rules` on plain values, the checks across
configuration sections (:meth:`Config.validate`, which calls them): the layout against
the world size, pipeline blocks and micro-batches, ZeRO options, the global batch. They
need no torch; that each allowed-value set is declared once is in
``test_values.py``, the checks the parallel layer owns are in
``tests/parallel/test_checks.py``."""

from __future__ import annotations

from typing import Any

import pytest

from plait import config
from plait.config import Config
from plait.config.coerce import config_from_dict
from plait.config.rules.choices import check_choice, check_positive, choice_error
from plait.config.rules.features import check_compression, check_compression_warmup, check_offload
from plait.config.rules.layout import (
    check_batch,
    check_chunks,
    check_cp_sequence,
    check_pipeline,
    check_pp_reshard,
    check_shard_size,
    check_sp_under_cp,
    check_ulysses_heads,
    check_world,
)
from plait.config.rules.model import check_seq_len, check_tokenizer_vocab
from plait.errors import ConfigError


def _cfg(**sections: dict[str, Any]) -> Config:
    return config_from_dict(sections)


# ----------------------------------------------------------------------------- check_world


def test_check_world_resolves_dp() -> None:
    assert check_world(None, 2, 2, 1, 8) == 2
    assert check_world(2, 2, 2, 1, 8) == 2
    assert check_world(None, 1, 1, 1, 1) == 1


@pytest.mark.parametrize(
    ("degrees", "world", "devices", "pattern"),
    [
        (
            (3, 1, 1, 1),
            2,
            False,
            r"^the layout dp=3 x tp=1 x pp=1 x cp=1 = 3 ranks does not match the world size "
            r"2; choose degrees whose product is 2 \(or start 3 processes\)\.$",
        ),
        (
            (None, 3, 1, 1),
            4,
            False,
            r"^tp=3 x pp=1 x cp=1 = 3 does not divide the world size 4; choose degrees whose "
            r"product divides 4\.$",
        ),
        (
            (4, 1, 1, 1),
            8,
            True,
            r"= 4 ranks does not match the 8 devices; .* \(or ask for 4 devices\)\.$",
        ),
        ((None, 3, 1, 1), 8, True, r"= 3 does not divide the 8 devices"),
        ((0, 4, 1, 1), 4, False, r"^the dp degree must be >= 1, got dp=0\.$"),
        ((None, 1, -1, 1), 4, False, r"^the pp degree must be >= 1, got pp=-1\.$"),
    ],
)
def test_check_world_refusals(
    degrees: tuple[int | None, int, int, int], world: int, devices: bool, pattern: str
) -> None:
    dp, tp, pp, cp = degrees
    with pytest.raises(ConfigError, match=pattern):
        check_world(dp, tp, pp, cp, world, devices=devices)


# ----------------------------------------------------------------------------- Config.validate


@pytest.mark.parametrize(
    ("cfg", "world", "pattern"),
    [
        (
            _cfg(parallel={"dp": 3}),
            2,
            r"dp=3 x tp=1 x pp=1 x cp=1 = 3 ranks does not match the world size 2.*"
            r"product is 2 \(or start 3 processes\)",
        ),
        (
            _cfg(parallel={"tp": 4}),
            2,
            r"dp=1 x tp=4 x pp=1 x cp=1 = 4 ranks does not match the world size 2",
        ),
        (
            _cfg(parallel={"cp": 4}, train={"seq_len": 36}),
            4,
            r"train.seq_len \(36\) must be divisible by 2 x cp = 8; use e.g. seq_len 32",
        ),
        (
            _cfg(parallel={"cp": 4, "cp_attention": "ulysses"}, train={"seq_len": 18}),
            4,
            r"Ulysses .* train.seq_len \(18\) must be divisible by 4",
        ),
        (
            _cfg(parallel={"cp": 2, "tp": 2, "cp_attention": "ulysses"}, model={"n_heads": 2}),
            4,
            r"1 query heads per tp rank \(model.n_heads 2 / tp 2\) are not divisible by 2",
        ),
        (
            _cfg(parallel={"cp": 2, "tp": 4, "sequence_parallel": True}, train={"seq_len": 36}),
            8,
            r"seq_len / cp = 18 tokens over tp = 4 ranks.*divisible by cp x tp = 8 x 2 \(ring\)",
        ),
        (
            _cfg(parallel={"pp": 4, "chunks": 2, "pipeline_schedule": "interleaved"}),
            4,
            r"4 transformer blocks .* pp 4 x chunks 2 = 8 pipeline pieces .*model.n_layers >= 8",
        ),
        (
            _cfg(
                parallel={"pp": 4, "pipeline_schedule": "interleaved", "microbatches": 2},
                model={"n_layers": 8},
            ),
            4,
            r"got 2 micro-batches for 4 stages; use 4 micro-batches",
        ),
        (
            _cfg(
                parallel={"pp": 2, "pipeline_schedule": "interleaved", "chunks": 2},
                train={"global_batch": 24, "micro_batch": 8},
            ),
            2,
            r"the interleaved schedule needs the micro-batches per step to be a multiple of "
            r"the pipeline stages .* got 3 micro-batches for 2 stages; use 2 or 4 micro-batches",
        ),
        (
            _cfg(parallel={"pp": 2, "microbatches": 3}),
            2,
            r"global_batch \(16\) must split into dp 1 x 3 pipeline micro-batches .* 16 "
            r"sequences per rank is not divisible by 3; .* among \[1, 2, 4, 8, 16\]",
        ),
        (
            _cfg(parallel={"pp": 2, "microbatches": 4}, train={"micro_batch": 2}),
            2,
            r"train.micro_batch \(2\) x parallel.microbatches \(4\) must equal .* = 16",
        ),
        (
            _cfg(parallel={"zero": 2, "zero_shard_size": 3}),
            4,
            r"zero_shard_size \(F = 3\) must divide the data-parallel degree dp = 4; "
            r"choose one of \[1, 2, 4\]",
        ),
        (
            _cfg(parallel={"zero_shard_size": 2}),
            2,
            r"zero_shard_size = 2 needs parallel\.zero >= 1",
        ),
        (
            _cfg(parallel={"offload": "optimizer"}),
            2,
            r"parallel\.offload = 'optimizer' needs ZeRO \(parallel\.zero >= 1\)",
        ),
        (
            _cfg(parallel={"zero": 2, "offload": "params"}),
            2,
            r"offload = 'params' needs parallel\.zero = 3 \(got 2\)",
        ),
        (
            _cfg(train={"global_batch": 16, "micro_batch": 3}),
            2,
            r"train\.global_batch \(16\) must be divisible by dp x micro_batch = 2 x 3 = 6; "
            r"for example use global_batch 12",
        ),
        (
            _cfg(train={"global_batch": 15}),
            2,
            r"global_batch \(15\) must be divisible by dp x micro_batch = 2 x 7 = 14",
        ),
        (_cfg(train={"global_batch": 1}), 2, r"= 2 x 1 = 2; for example use global_batch 2"),
        (
            _cfg(train={"seq_len": 300}),
            2,
            r"train\.seq_len \(300\) exceeds model\.max_seq_len \(256\)",
        ),
        (
            _cfg(model={"vocab_size": 128}),
            1,
            r"byte tokenizer needs model\.vocab_size >= 256, got 128",
        ),
    ],
)
def test_validate_messages(cfg: Config, world: int, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        cfg.validate(world)


def test_validate_passes() -> None:
    Config().validate(2)
    Config().validate(1)
    for stage in (1, 2, 3):
        _cfg(parallel={"zero": stage, "zero_shard_size": 2, "offload": "optimizer"}).validate(4)
    _cfg(parallel={"zero": 3, "offload": "params"}, train={"recompute": "full"}).validate(2)
    _cfg(parallel={"zero_shard_size": 1}, precision={"dtype": "bf16"}).validate(2)
    _cfg(model={"vocab_size": 100}, data={"tokenizer": "tiktoken:x"}).validate(1)
    _cfg(train={"seq_len": 256}).validate(4)
    _cfg(parallel={"tp": 2, "sequence_parallel": True, "zero": 3}).validate(4)  # dp2 x tp2
    for stage in (2, 3):  # ZeRO-2/3 under pipeline parallelism (pp2 x dp2)
        _cfg(parallel={"pp": 2, "zero": stage, "pp_grad_reduce": "microbatch"}).validate(4)
    _cfg(parallel={"pp": 2, "zero": 3, "pp_reshard": True}).validate(4)
    _cfg(parallel={"tp": 4}, model={"vocab_size": 257, "n_kv_heads": 2}).validate(4)


# ----------------------------------------------------------------------------- the rules


def test_check_choice() -> None:
    check_choice("x", "b", ("a", "b"))
    with pytest.raises(ConfigError, match=r"^parallel\.offload must be none, optimizer or "):
        check_choice("parallel.offload", "disk", config.OFFLOADS)
    with pytest.raises(ConfigError, match=r"^x must be a, got 'b'\.$"):
        check_choice("x", "b", ("a",))
    with pytest.raises(ConfigError, match=r"^ZeRO stage must be 0, 1, 2 or 3, got 4: 0 = plain"):
        check_choice("ZeRO stage", 4, config.ZERO_STAGES, config.ZERO_MEANING)
    with pytest.raises(ConfigError, match=r"got True"):  # its own type: True is not 1
        check_choice("parallel.zero", True, config.ZERO_STAGES)
    assert str(choice_error("k", "v", ("a", "b"))) == "k must be a or b, got 'v'."


def test_check_positive() -> None:
    check_positive("train.", steps=1, micro_batch=None)
    with pytest.raises(ConfigError, match=r"^train\.steps must be positive, got 0\.$"):
        check_positive("train.", steps=0)
    with pytest.raises(ConfigError, match=r"^layout dp must be positive, got -1\.$"):
        check_positive("layout ", tp=1, dp=-1)


def test_check_shard_size() -> None:
    for factor, zero, dp in [(None, 0, 4), (1, 0, 4), (2, 1, 4), (4, 3, 4), (None, 3, 3)]:
        check_shard_size(factor, zero, dp)
    with pytest.raises(ConfigError, match=r"zero_shard_size = 2 needs parallel\.zero >= 1"):
        check_shard_size(2, 0, 4)
    with pytest.raises(ConfigError, match=r"\(F = 3\) must divide .* dp = 4; .* \[1, 2, 4\]"):
        check_shard_size(3, 2, 4)
    with pytest.raises(ConfigError, match=r"\(F = 0\) must divide"):
        check_shard_size(0, 2, 4)


def test_check_offload() -> None:
    for offload, zero in [("none", 0), ("optimizer", 1), ("optimizer", 2), ("params", 3)]:
        check_offload(offload, zero)
    with pytest.raises(ConfigError, match=r"offload = 'optimizer' needs ZeRO \(parallel\.zero"):
        check_offload("optimizer", 0)
    with pytest.raises(ConfigError, match=r"offload = 'params' needs parallel\.zero = 3 \(got 1\)"):
        check_offload("params", 1)


def test_check_compression() -> None:
    check_compression("none", 3, "bf16", "bf16")
    check_compression("topk", 0, "fp32", "auto")
    check_compression("powersgd", 0)  # the planner knows no precision
    with pytest.raises(ConfigError, match=r"plain data parallelism \(zero 0\) only, not with"):
        check_compression("topk", 1)
    with pytest.raises(ConfigError, match=r"needs plain data parallelism with fp32 .*'bf16'"):
        check_compression("fp16", 0, "bf16", "auto")
    with pytest.raises(ConfigError, match=r"reduce_dtype = 'fp16'"):
        check_compression("fp16", 0, "fp32", "fp16")


def test_check_compression_warmup() -> None:
    check_compression_warmup(0, 0.01)
    check_compression_warmup(500, 0.01)
    for bad in (-1, 2.5, True):
        with pytest.raises(ConfigError, match=r"compression_warmup_steps must be a whole .*25 %"):
            check_compression_warmup(bad, 0.01)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="compression_warmup_steps"):
        config.ParallelConfig(compression_warmup_steps=-3)


def test_check_pp_reshard_and_chunks() -> None:
    check_pp_reshard(False, 0, 1)
    check_pp_reshard(True, 3, 2)
    for zero, pp in [(2, 2), (3, 1)]:
        with pytest.raises(ConfigError, match=rf"\(got zero {zero}, pp {pp}\)"):
            check_pp_reshard(True, zero, pp)
    check_chunks("interleaved", 3)
    check_chunks("1f1b", 1)
    with pytest.raises(ConfigError, match=r"schedule 'gpipe' runs one model chunk per rank"):
        check_chunks("gpipe", 2)


def test_check_context_rules() -> None:
    check_cp_sequence(32, 4, "ring")
    check_cp_sequence(12, 4, "ulysses")
    with pytest.raises(ConfigError, match=r"seq_len \(12\) must be divisible by 2 x cp = 8"):
        check_cp_sequence(12, 4, "ring")
    with pytest.raises(ConfigError, match=r"Ulysses .*seq_len \(10\) must be divisible by 4"):
        check_cp_sequence(10, 4, "ulysses")
    check_ulysses_heads(8, 2, 4)
    check_ulysses_heads(8, 3, 4)  # tp does not divide the heads: they are not split by it
    with pytest.raises(ConfigError, match=r"6 query heads \(model\.n_heads 6\) are not"):
        check_ulysses_heads(6, 1, 4)
    check_sp_under_cp(32, 2, 4, "ring")
    check_sp_under_cp(30, 2, 1, "ring")  # tp 1: no sequence parallelism
    with pytest.raises(ConfigError, match=r"divisible by cp x tp = 8\.$"):
        check_sp_under_cp(36, 2, 4, "ulysses")


def test_check_pipeline_and_batch() -> None:
    check_pipeline(4, 2, 1, "1f1b", 4, 16, 2, None)
    check_pipeline(8, 2, 2, "interleaved", 4, 16, 1, 4)
    with pytest.raises(ConfigError, match=r"pp 2 x chunks 2 = 4 pipeline pieces"):
        check_pipeline(3, 2, 2, "interleaved", 4, 16, 1, None)
    with pytest.raises(ConfigError, match=r"not divisible by 3"):
        check_pipeline(4, 2, 1, "1f1b", 3, 16, 1, None)
    check_batch(16, 2, 4)
    with pytest.raises(ConfigError, match=r"for example use global_batch 12"):
        check_batch(16, 2, 3)
    check_seq_len(256, 256)
    with pytest.raises(ConfigError, match=r"seq_len \(257\) exceeds model\.max_seq_len \(256\)"):
        check_seq_len(257, 256)
    check_tokenizer_vocab("tiktoken:x", 100)
    with pytest.raises(ConfigError, match=r"vocab_size >= 256, got 255"):
        check_tokenizer_vocab("byte", 255)
