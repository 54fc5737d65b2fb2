"""The configuration sections: each one's own checks (``__post_init__``) and what a
:class:`Config` derives (data-parallel degree, micro-batches, accumulation, learning rate).
The checks across sections are in ``test_rules.py``; loading is in
``test_io.py``."""

from __future__ import annotations

from typing import Any

import pytest

from plait.config import (
    Config,
    DataConfig,
    LaunchConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
)
from plait.config.coerce import config_from_dict
from plait.errors import ConfigError

# ----------------------------------------------------------------------------- __post_init__


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda: ModelConfig(vocab_size=0), r"model\.vocab_size must be positive, got 0"),
        (lambda: ModelConfig(dim=-8), r"model\.dim must be positive, got -8"),
        (lambda: ModelConfig(n_layers=0), r"model\.n_layers must be positive"),
        (lambda: ModelConfig(n_heads=0), r"model\.n_heads must be positive"),
        (lambda: ModelConfig(n_kv_heads=0), r"model\.n_kv_heads must be positive"),
        (lambda: ModelConfig(ffn_dim=0), r"model\.ffn_dim must be positive"),
        (lambda: ModelConfig(multiple_of=0), r"model\.multiple_of must be positive"),
        (lambda: ModelConfig(max_seq_len=0), r"model\.max_seq_len must be positive"),
        (lambda: ModelConfig(rope_theta=0.0), r"model\.rope_theta must be positive"),
        (lambda: ModelConfig(norm_eps=-1e-5), r"model\.norm_eps must be positive"),
        (lambda: ModelConfig(init_std=0.0), r"model\.init_std must be positive"),
        (lambda: ModelConfig(dim=130, n_heads=4), r"model\.dim \(130\) must be divisible by"),
        (lambda: ModelConfig(dim=12, n_heads=4), r"head dimension dim/n_heads = 3 must be even"),
        (
            lambda: ModelConfig(n_heads=4, n_kv_heads=3),
            r"model\.n_heads \(4\) must be divisible by model\.n_kv_heads \(3\)",
        ),
        (lambda: ParallelConfig(dp=0), r"parallel\.dp must be positive"),
        (lambda: ParallelConfig(tp=0), r"parallel\.tp must be positive"),
        (lambda: ParallelConfig(pp=-1), r"parallel\.pp must be positive"),
        (lambda: ParallelConfig(cp=0), r"parallel\.cp must be positive"),
        (lambda: ParallelConfig(bucket_mb=0.0), r"parallel\.bucket_mb must be positive"),
        (lambda: ParallelConfig(timeout_s=0.0), r"parallel\.timeout_s must be positive"),
        (lambda: ParallelConfig(zero=4), r"parallel\.zero must be 0, 1, 2 or 3, got 4"),
        (lambda: ParallelConfig(zero=-1), r"parallel\.zero must be 0, 1, 2 or 3, got -1"),
        (lambda: ParallelConfig(backend="mpi"), r"parallel\.backend must be auto, gloo or nccl"),
        (lambda: ParallelConfig(zero_shard_size=0), r"parallel\.zero_shard_size must be positive"),
        (lambda: ParallelConfig(offload="disk"), r"parallel\.offload must be none, optimizer or"),
        (lambda: TrainConfig(recompute="some"), r"train\.recompute must be none, selective or"),
        (lambda: PrecisionConfig(dtype="fp8"), r"precision\.dtype must be fp32, bf16 or fp16"),
        (lambda: PrecisionConfig(reduce_dtype="fp64"), r"precision\.reduce_dtype must be auto"),
        (lambda: PrecisionConfig(nonfinite="ignore"), r"precision\.nonfinite must be error or"),
        (lambda: PrecisionConfig(loss_scale=0.0), r"precision\.loss_scale must be positive"),
        (lambda: PrecisionConfig(loss_scale_window=0), r"precision\.loss_scale_window must be"),
        (lambda: TrainConfig(steps=0), r"train\.steps must be positive"),
        (lambda: TrainConfig(global_batch=0), r"train\.global_batch must be positive"),
        (lambda: TrainConfig(micro_batch=0), r"train\.micro_batch must be positive"),
        (lambda: TrainConfig(seq_len=0), r"train\.seq_len must be positive"),
        (lambda: TrainConfig(lr=0.0), r"train\.lr must be positive"),
        (lambda: TrainConfig(base_batch=0), r"train\.base_batch must be positive"),
        (lambda: TrainConfig(eval_batches=0), r"train\.eval_batches must be positive"),
        (lambda: TrainConfig(min_lr_ratio=1.5), r"train\.min_lr_ratio must be in \[0, 1\]"),
        (lambda: TrainConfig(min_lr_ratio=-0.1), r"train\.min_lr_ratio must be in \[0, 1\]"),
        (lambda: TrainConfig(warmup_steps=-1), r"warmup_steps and train\.eval_every must not be"),
        (lambda: TrainConfig(eval_every=-1), r"warmup_steps and train\.eval_every must not be"),
        (lambda: TrainConfig(weight_decay=-0.1), r"weight_decay and train\.grad_clip must not"),
        (lambda: TrainConfig(grad_clip=-1.0), r"weight_decay and train\.grad_clip must not"),
        (lambda: TrainConfig(beta1=1.0), r"train\.beta1 must be in \[0, 1\), got 1\.0"),
        (lambda: TrainConfig(beta2=-0.5), r"train\.beta2 must be in \[0, 1\), got -0\.5"),
        (lambda: DataConfig(source=""), r"data\.source must not be empty"),
        (lambda: DataConfig(tokenizer="bpe"), r"data\.tokenizer must be 'byte' or 'tiktoken:"),
        (lambda: DataConfig(token_dtype="int8"), r"data\.token_dtype must be uint16 or uint32"),
        (lambda: DataConfig(max_bytes=-1), r"data\.max_bytes must not be negative, got -1"),
        (lambda: DataConfig(val_fraction=0.0), r"data\.val_fraction must be in \(0, 1\)"),
        (lambda: DataConfig(val_fraction=1.0), r"data\.val_fraction must be in \(0, 1\)"),
        (lambda: LogConfig(log_every=0), r"log\.log_every must be positive"),
        (lambda: LogConfig(peak_tflops=0.0), r"log\.peak_tflops must be positive"),
        (lambda: LogConfig(timeline="step.svg"), r"log\.timeline must name a \.png file"),
        (lambda: LogConfig(progress="fancy"), r"log\.progress must be auto, bar, lines or none"),
        (
            lambda: ParallelConfig(pp_grad_reduce="bucket"),  # type: ignore[arg-type]
            r"parallel\.pp_grad_reduce must be step or microbatch, got 'bucket'",
        ),
        (
            lambda: ParallelConfig(pp=2, zero=2, pp_reshard=True),
            r"pp_reshard .* needs parallel\.zero = 3 and parallel\.pp > 1 "
            r"\(got zero 2, pp 2\)",
        ),
        (lambda: LaunchConfig(nproc=0), r"launch\.nproc must be positive"),
        (lambda: LaunchConfig(threads=0), r"launch\.threads must be positive"),
        (lambda: LaunchConfig(device="tpu"), r"launch\.device must be auto, cpu or cuda"),
    ],
)
def test_post_init_messages(make: Any, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        make()


def test_post_init_accepts_edge_values() -> None:
    TrainConfig(min_lr_ratio=0.0, warmup_steps=0, eval_every=0, grad_clip=0.0, beta1=0.0)
    TrainConfig(min_lr_ratio=1.0, weight_decay=0.0)
    DataConfig(max_bytes=0, tokenizer="tiktoken:cl100k_base", token_dtype="uint32")
    ModelConfig(dim=64, n_heads=8, n_kv_heads=1)
    for stage in (0, 1, 2, 3):
        ParallelConfig(zero=stage)


# ----------------------------------------------------------------------------- derived values


def _cfg(**sections: dict[str, Any]) -> Config:
    return config_from_dict(sections)


def test_micro_batch_and_accumulation_derivation() -> None:
    cfg = _cfg(parallel={"dp": 2}, train={"global_batch": 16, "micro_batch": 4})
    cfg.validate(2)
    assert cfg.micro_batch(2) == 4 and cfg.accumulation_steps(2) == 2
    default = _cfg(train={"global_batch": 16})
    default.validate(2)
    assert default.micro_batch(2) == 8 and default.accumulation_steps(2) == 1
    assert default.micro_batch(4) == 4 and default.accumulation_steps(4) == 1


def test_resolved_dp() -> None:
    assert ParallelConfig().resolved_dp(4) == 4
    assert ParallelConfig(dp=2).resolved_dp(4) == 2
    assert ParallelConfig(tp=2).resolved_dp(8) == 4
    assert ParallelConfig(tp=2, pp=2, cp=2).resolved_dp(4) == 1  # never below one


def test_effective_lr_and_model_defaults() -> None:
    assert TrainConfig(lr=1e-3, scale_lr=True, global_batch=64, base_batch=16).effective_lr() == (
        pytest.approx(4e-3)
    )
    assert TrainConfig(lr=1e-3, global_batch=64).effective_lr() == 1e-3
    model = ModelConfig(dim=128, n_heads=4)
    assert model.kv_heads == 4 and model.head_dim == 32 and model.hidden_dim == 352
    assert ModelConfig(ffn_dim=100).hidden_dim == 100
