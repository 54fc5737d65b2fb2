"""The training loop: schedule, determinism, and parity of the layouts it runs.

Parity here is at the level of the whole trainer (data sampling, accumulation, loss
averaging) in float32: losses agree with one process to rtol 1e-5 (summation order is
the only difference); tests/parallel/test_data_parallel.py checks the wrapper itself in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from plait import init_mesh
from plait.config import Config, TrainConfig
from plait.testing import WorkerContext, WorkerPool
from plait.train.trainer import Trainer, lr_at
from tests.tiny import tiny_config

M = "tests.train.test_trainer"


def _run(cfg: Config, dp: int | None, ctx: WorkerContext | None) -> dict[str, object]:
    mesh = ctx.mesh(dp=dp) if ctx is not None else init_mesh()
    s = Trainer(cfg, mesh, show_progress=False).run()
    return {"losses": s.losses, "vals": s.val_losses, "bytes": mesh.stats.total_bytes("dp")}


def _body_run(ctx: WorkerContext, micro_batch: int | None) -> dict[str, object]:
    return _run(tiny_config(micro_batch), ctx.world_size, ctx)


def test_lr_schedule_warmup_cosine_and_scaling() -> None:
    cfg = Config(train=TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1))
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)
    scaled = Config(
        train=TrainConfig(lr=1.0, global_batch=64, base_batch=16, scale_lr=True, warmup_steps=0)
    )
    assert lr_at(0, scaled) == pytest.approx(4.0)


def test_same_command_twice_gives_same_losses() -> None:
    a = _run(tiny_config(), None, None)
    b = _run(tiny_config(), None, None)
    assert a["losses"] == b["losses"] and a["vals"] == b["vals"]


def test_loss_falls() -> None:
    losses = _run(tiny_config(steps=30), None, None)["losses"]
    assert isinstance(losses, list)
    assert losses[-1] < losses[0] - 1.0


@pytest.fixture(scope="module")
def one_process() -> dict[str, object]:
    return _run(tiny_config(), None, None)


@pytest.mark.parametrize(("world", "micro_batch"), [(2, None), (2, 2), (4, None)])
def test_trainer_layouts_match_one_process(
    pools: Callable[[int], WorkerPool],
    one_process: dict[str, object],
    world: int,
    micro_batch: int | None,
) -> None:
    """dp2, dp2 x accumulation 2 (micro 2), dp4: same global batch, same losses."""
    ref = one_process
    results = pools(world).run(f"{M}:_body_run", micro_batch)
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        vals = [v for _, v in r["vals"]]  # type: ignore[attr-defined]
        assert vals == pytest.approx([v for _, v in ref["vals"]], rel=1e-5)  # type: ignore[attr-defined]
    # every rank reports the same global loss
    assert all(r["losses"] == results[0]["losses"] for r in results)


def _grads_after_step_1(cfg: Config, dp: int | None, ctx: WorkerContext | None) -> dict:
    """The full gradients of the trainer's first step (before the optimizer uses them):
    the data-parallel average over the global batch, on every rank."""
    mesh = ctx.mesh(dp=dp) if ctx is not None else init_mesh()
    tr = Trainer(cfg, mesh, show_progress=False)
    x, y = tr._batch(0)
    tr.model.step(x, y, micro_batches=tr.accum)
    return {n: p.grad.detach().clone() for n, p in tr.base.named_parameters()}


def _body_grads(ctx: WorkerContext, micro_batch: int | None) -> dict:
    return _grads_after_step_1(tiny_config(micro_batch), ctx.world_size, ctx)


@pytest.mark.parametrize(("world", "micro_batch"), [(2, 2), (4, None)])
def test_trainer_gradients_after_step_1_match_one_process(
    pools: Callable[[int], WorkerPool], world: int, micro_batch: int | None
) -> None:
    """Losses alone cannot see a gradient off by a constant factor (AdamW normalises it
    away, clipping caps it): the first step's gradients themselves are compared (fp32,
    rtol 1e-5, atol 1e-7; only the summation order differs)."""
    ref = _grads_after_step_1(tiny_config(), None, None)
    for grads in pools(world).run(f"{M}:_body_grads", micro_batch):
        assert grads.keys() == ref.keys()
        for n, g in ref.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-7, msg=n)


def test_one_process_accumulation_matches() -> None:
    ref = _run(tiny_config(), None, None)
    acc = _run(tiny_config(micro_batch=2), None, None)  # 4 micro-steps of 2
    assert acc["losses"] == pytest.approx(ref["losses"], rel=1e-5)
