"""``log.sample_every``: the trainer prints a greedy sample every N steps on rank 0, with
every rank decoding; the samples under tp2 and ZeRO-3 dp2 equal one process's, and the
layouts generation cannot run on are refused before anything starts.

Tolerance: losses relative 1e-5 (float32 layouts differ in summation order); the
sampled text identical (the one-process run checks that its greedy margins exceed
1e-4, far above the layouts' weight differences after two steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from plait import init_mesh
from plait.config import Config, LogConfig, ParallelConfig
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.testing import WorkerContext, WorkerPool
from plait.train.sample import inner_model
from plait.train.trainer import Trainer
from tests.tiny import tiny_config

M = "tests.train.test_sample"


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: these tiny models run ~30x slower with two on a busy machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _config(parallel: dict[str, Any] | None = None, **log: Any) -> Config:
    base = tiny_config(steps=2, parallel=parallel)
    fields = {"progress": "lines", "peak_tflops": 1.0, "sample_every": 1, "sample_tokens": 10}
    return dataclasses.replace(base, log=LogConfig(**{**fields, **log}))


def _train(cfg: Config, mesh: Mesh) -> tuple[list[float], list[str], float]:
    """Losses, the sample lines printed (and the first step's peak-memory line), and the
    smallest greedy margin of the final model on the last sample's text (one process
    only; else 1.0)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer = Trainer(cfg, mesh)
        summary = trainer.run()
    heads = ("plait: sample at step", "plait: peak memory in step")
    lines = [s for s in out.getvalue().splitlines() if s.startswith(heads)]
    margin = 1.0
    if mesh.world_size == 1:
        model = inner_model(trainer.model)
        ids = torch.tensor([list(trainer.samples.prompt)])  # type: ignore[union-attr]
        with torch.no_grad():
            for _ in range(cfg.log.sample_tokens):
                last = model(ids)[0, -1]
                top = torch.topk(last, 2).values
                margin = min(margin, float(top[0] - top[1]))
                ids = torch.cat([ids, torch.argmax(last).view(1, 1)], dim=1)
    return summary.losses, lines, margin


def _body(ctx: WorkerContext, parallel: dict[str, Any]) -> tuple[list[float], list[str]]:
    cfg = _config(parallel)
    p = cfg.parallel
    losses, lines, _ = _train(cfg, ctx.mesh(dp=p.resolved_dp(2), tp=p.tp))
    return losses, lines


@pytest.mark.parametrize("parallel", [{"tp": 2}, {"dp": 2, "zero": 3}], ids=["tp2", "zero3-dp2"])
def test_samples_under_a_layout_equal_one_process(
    pools: Callable[[int], WorkerPool], parallel: dict[str, Any]
) -> None:
    losses, printed, margin = _train(_config(), init_mesh())
    peaks, lines = printed[0], printed[1:]
    assert margin > 1e-4
    assert peaks.startswith("plait: peak memory in step 1: rank 0 host ")
    assert [s.split(": ")[0:2] for s in lines] == [
        ["plait", "sample at step 1"],
        ["plait", "sample at step 2"],
    ]
    assert lines[0] != lines[1]  # the model changed between the samples
    rank0, rank1 = pools(2).run(f"{M}:_body", parallel)
    assert rank0[0] == pytest.approx(losses, rel=1e-5)
    assert rank0[1][1:] == lines  # rank 0 prints the one-process samples
    assert rank1[1] == []  # and no other rank prints
    step = rank0[1][0]  # every rank's step peaks; ZeRO-3's counted transient
    assert "; rank 1 host " in step
    assert ("ZeRO-3 transient" in step) == (parallel.get("zero") == 3)


@pytest.mark.parametrize(
    ("parallel", "log", "message"),
    [
        ({"pp": 2}, {}, "log.sample_every needs the whole model on each rank; pp = 2"),
        ({"tp": 2, "sequence_parallel": True}, {}, "set parallel.sequence_parallel = false"),
        ({}, {"sample_prompt": "x" * 30}, "log.sample_prompt (30 bytes, up to as many"),
        ({}, {"sample_every": -1}, "log.sample_every must be 0 (off) or positive"),
        ({}, {"sample_prompt": ""}, "log.sample_prompt must not be empty"),
        ({}, {"sample_tokens": 0}, "log.sample_tokens must be positive"),
    ],
    ids=["pp2", "sequence-parallel", "too-long", "negative", "empty-prompt", "no-tokens"],
)
def test_layouts_and_lengths_generation_cannot_run_are_refused(
    parallel: dict[str, Any], log: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as e:
        cfg = _config(**log)
        cfg = dataclasses.replace(cfg, parallel=ParallelConfig(**parallel))
        cfg.validate(2)
    assert message in str(e.value)
