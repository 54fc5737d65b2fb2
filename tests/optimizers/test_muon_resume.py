"""Muon's state in checkpoints: resuming is bit-exact in one process and under ZeRO-3 dp2
(the momentum is element-wise state on each rank's shard pieces, saved like AdamW's)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from plait.checkpoint import CheckpointReader, step_dirname
from plait.config import Config
from plait.testing import WorkerPool
from tests.checkpoint.test_checkpoint import SAVE_AT, _assert_same_weights, _pool_run, config


def _muon(root: str, resume: str | None = None, zero: int = 0) -> Config:
    cfg = config(root, resume=resume, zero=zero)
    cfg.train.optimizer = "muon"
    cfg.optim.muon_lr = 0.02
    return cfg


@pytest.mark.parametrize("world, zero", [(1, 0), (2, 3)])
def test_muon_resume_is_bit_exact(
    pools: Callable[[int], WorkerPool], tmp_path: Path, world: int, zero: int
) -> None:
    root = str(tmp_path / "ck")
    full = _pool_run(pools, world, _muon(root, zero=zero))
    ck = Path(root) / step_dirname(SAVE_AT)
    keys = CheckpointReader(ck).meta["params"]["layers.0.attention.wq.weight"]["pieces"][0]["keys"]
    assert "momentum_buffer" in keys
    resumed = _pool_run(pools, world, _muon(root, resume=str(ck), zero=zero))
    assert resumed["start"] == SAVE_AT
    assert resumed["losses"] == full["losses"][SAVE_AT:]
    _assert_same_weights(resumed["final"], full["final"])
