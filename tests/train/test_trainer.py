"""The training loop: schedule, determinism, and parity of the layouts it runs.

Parity here is at the level of the whole trainer (data sampling, accumulation, loss
averaging) in float32: losses agree with one process to rtol 1e-5 (summation order is
the only difference); tests/parallel/test_data.py checks the wrapper itself in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

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


def test_one_process_accumulation_matches() -> None:
    ref = _run(tiny_config(), None, None)
    acc = _run(tiny_config(micro_batch=2), None, None)  # 4 micro-steps of 2
    assert acc["losses"] == pytest.approx(ref["losses"], rel=1e-5)
