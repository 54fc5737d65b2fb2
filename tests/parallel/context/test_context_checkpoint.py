"""Checkpoints across context parallelism: cp does not shard parameters, so a cp2
checkpoint (ZeRO-3 over dp x cp: each cp rank writes its own shard) loads under cp1 and
tp2 with bit-equal weights, and a tp2 checkpoint loads under cp2."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.checkpoint import step_dirname
from plait.config import Config
from plait.testing import WorkerContext, WorkerPool
from plait.train.trainer import Trainer
from tests.checkpoint.test_checkpoint import SAVE_AT, _merged, config, full_weights

Pools = Callable[[int], WorkerPool]


def _cfg(root: str, resume: str | None = None, **parallel: Any) -> Config:
    c = config(root, steps=SAVE_AT + 1 if resume else SAVE_AT, resume=resume)
    return dataclasses.replace(c, parallel=dataclasses.replace(c.parallel, **parallel))


def _body(ctx: WorkerContext, cfg: Config) -> dict[str, Any]:
    p = cfg.parallel
    mesh = ctx.mesh(dp=ctx.world_size // (p.tp * p.cp), tp=p.tp, cp=p.cp)
    tr = Trainer(cfg, mesh, show_progress=False)
    loaded = full_weights(tr)
    losses = tr.run().losses
    return {
        "loaded": loaded,
        "snap": {},
        "final": full_weights(tr),
        "losses": losses,
        "start": tr.start_step,
    }


def _run(pools: Pools | None, world: int, cfg: Config) -> dict[str, Any]:
    if pools is None:
        from plait import init_mesh

        tr = Trainer(cfg, init_mesh(), show_progress=False)
        loaded = full_weights(tr)
        return {
            "loaded": loaded,
            "losses": tr.run().losses,
            "final": full_weights(tr),
            "start": tr.start_step,
        }
    return _merged(pools(world).run(_body, cfg))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ((2, {"cp": 2, "zero": 3}), (1, {})),
        ((2, {"cp": 2, "zero": 3}), (2, {"tp": 2})),
        ((2, {"tp": 2}), (2, {"cp": 2})),
    ],
    ids=["cp2-zero3-to-cp1", "cp2-zero3-to-tp2", "tp2-to-cp2"],
)
def test_reshard_across_cp(pools: Pools, tmp_path: Path, src: Any, dst: Any) -> None:
    root = str(tmp_path / "ck")
    saved = _run(pools, src[0], _cfg(root, **src[1]))
    ck = str(Path(root) / step_dirname(SAVE_AT))
    resumed = _run(pools if dst[0] > 1 else None, dst[0], _cfg(root, resume=ck, **dst[1]))
    assert resumed["start"] == SAVE_AT
    assert saved["final"].keys() == resumed["loaded"].keys()
    for name, want in saved["final"].items():
        assert torch.equal(resumed["loaded"][name], want), name
    assert len(resumed["losses"]) == 1  # and it trains on from there
