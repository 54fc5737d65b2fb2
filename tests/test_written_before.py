"""A TOML config and a checkpoint written by an older plait still load, value for value.

``fixtures/written_before/`` was written by ``fixtures/make_written_before.py`` at the
commit ``expected.json`` names (before the configuration moved into one package); it is
never regenerated. ``config.toml`` must read back into exactly :func:`written_config`;
``step_00000002`` must give a fresh one-process build of :func:`tiny_config` (same seed) the
parameters, AdamW state, counters and loss that the writing code held.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.checkpoint import CheckpointReader, TrainState, find_checkpoint, restore_training_state
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
from plait.config.coerce import config_from_dict, config_to_dict
from plait.config.toml_io import load_config
from plait.data import BatchSampler
from plait.mesh import init_mesh
from plait.optim import Optimizer
from plait.parallel.parallelize import parallelize
from plait.train.start import make_optimizer, one_device_model

FIXTURE = Path(__file__).parent / "fixtures" / "written_before"


def written_config() -> Config:
    """The configuration ``config.toml`` holds: every section, non-default values."""
    return Config(
        model=ModelConfig(
            dim=64,
            n_layers=6,
            n_heads=8,
            n_kv_heads=2,
            max_seq_len=512,
            tie_embeddings=True,
            rope_scaling="llama3",
            rope_factor=8.0,
            moe_experts=4,
            moe_top_k=1,
            moe_router="sigmoid",
        ),
        parallel=ParallelConfig(
            dp=2,
            tp=2,
            pp=2,
            cp=1,
            sequence_parallel=True,
            pipeline_schedule="interleaved",
            microbatches=8,
            chunks=3,
            balance="measured",
            zero=1,
            zero_shard_size=2,
            pp_grad_reduce="microbatch",
            offload="none",
            bucket_mb=12.5,
            compression="bf16",
            ep=2,
            timeout_s=60.0,
        ),
        train=TrainConfig(
            steps=123,
            global_batch=64,
            micro_batch=4,
            seq_len=256,
            lr=1e-4,
            warmup_steps=7,
            recompute="full",
            checkpoint_dir="ck",
            checkpoint_every=50,
            loss_chunk=1024,
        ),
        precision=PrecisionConfig(dtype="bf16", reduce_dtype="fp32", nonfinite="skip"),
        data=DataConfig(source="tinyshakespeare", val_fraction=0.1, mask_documents=True),
        log=LogConfig(dir="runs/x", metrics="m.jsonl", progress="none", sample_prompt='a "b"\n'),
        launch=LaunchConfig(nproc=8, device="cpu", threads=1),
    )


def tiny_config() -> Config:
    """The checkpoint's run: a one-process tiny model."""
    return Config(
        model=ModelConfig(
            vocab_size=32,
            dim=8,
            n_layers=1,
            n_heads=2,
            multiple_of=8,
            max_seq_len=16,
            tie_embeddings=True,
        ),
        train=TrainConfig(steps=4, global_batch=4, seq_len=16, warmup_steps=1, seed=7),
        data=DataConfig(max_bytes=10_000),
        log=LogConfig(progress="none"),
        launch=LaunchConfig(nproc=1, device="cpu"),
    )


def build(cfg: Config) -> TrainState:
    """A fresh one-process model (seeded by ``train.seed``), its AdamW and a sampler."""
    mesh = init_mesh()
    model = parallelize(one_device_model(cfg, mesh.device), mesh, cfg)
    optimizer = Optimizer(model, make_optimizer(model, cfg), max_norm=cfg.train.grad_clip)
    sampler = BatchSampler(64, cfg.train.global_batch, 0, 1, cfg.train.seed)
    return TrainState(model, optimizer, sampler, mesh, cfg)


def sha(t: torch.Tensor) -> str:
    """As the generator spells it: dtype, shape and the sha256 of the bytes."""
    t = t.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}:{hashlib.sha256(raw).hexdigest()}"


def test_a_toml_config_written_before_reads_back_equal() -> None:
    cfg = load_config(str(FIXTURE / "config.toml"))
    assert cfg == written_config()
    assert cfg != Config() and cfg.parallel.pipeline_schedule == "interleaved"
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_a_checkpoint_written_before_restores_its_values() -> None:
    want: dict[str, Any] = json.loads((FIXTURE / "expected.json").read_text("utf-8"))
    folder = FIXTURE / want["folder"]
    cfg = config_from_dict(CheckpointReader(folder, verify=False).meta["config"])
    assert cfg == tiny_config()  # the config recorded in the metadata reads back too
    ts = build(cfg)
    params = dict(ts.model.module.named_parameters())
    assert {n: sha(p) for n, p in params.items()} != want["params"]  # fresh: not trained
    reader = find_checkpoint(str(folder), None)  # every file's sha256 verified
    assert reader is not None
    try:
        assert restore_training_state(ts, reader) == 2
    finally:
        reader.close()
    assert {n: sha(p) for n, p in params.items()} == want["params"]
    names = {id(p): n for n, p in params.items()}
    state = {
        f"{names[id(p)]}/{k}": sha(v)
        for p, st in ts.optimizer.inner.state.items()
        for k, v in st.items()
    }
    assert state == want["optimizer_state"] and any(k.endswith("/exp_avg_sq") for k in state)
    assert (ts.optimizer.steps, ts.sched_step) == (want["opt_steps"], want["sched_step"]) == (2, 2)
    # the loader state of that time names no order: it resumes with the old one (issue 44)
    assert ts.sampler.state_dict() == {**want["sampler"], "order": "randperm"}
    tokens = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(3))
    loss = float(ts.model.evaluate(tokens[:, :-1], tokens[:, 1:]))
    assert loss == pytest.approx(want["loss"], rel=1e-6)
