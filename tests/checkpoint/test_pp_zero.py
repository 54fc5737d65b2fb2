"""Checkpoints of ZeRO-2/3 under pipeline parallelism (pp2 x dp2, 4 gloo ranks).

Each pipeline rank's ZeroDataParallel writes its own stage's flat-shard pieces
(``local_pieces``, named as in the one-device model). Protocol of
tests/checkpoint/test_checkpoint.py (its helpers): the Trainer runs STEPS steps saving after
SAVE_AT; resuming under the same layout is bit-exact (losses and final weights); resuming
under another layout (ZeRO-1 over dp2) loads exactly the weights the source held after
SAVE_AT and continues with the same losses (rel 1e-5)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from plait.checkpoint import step_dirname
from plait.testing import WorkerPool
from tests.checkpoint.test_checkpoint import (
    SAVE_AT,
    _assert_same_weights,
    _pool_run,
    config,
)

LAYOUT = {"pp": 2, "zero": 3}


def test_pp_zero3_resume_is_bit_exact(pools: Callable[[int], WorkerPool], tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    full = _pool_run(pools, 4, config(root, **LAYOUT), weights_at=SAVE_AT)
    ck = str(Path(root) / step_dirname(SAVE_AT))
    resumed = _pool_run(pools, 4, config(root, resume=ck, **LAYOUT))
    assert resumed["start"] == SAVE_AT
    _assert_same_weights(resumed["loaded"], full["snap"])
    assert resumed["losses"] == full["losses"][SAVE_AT:]
    _assert_same_weights(resumed["final"], full["final"])
    # and under another layout: ZeRO-1 over dp2 (no pipeline)
    other = _pool_run(pools, 2, config(None, resume=ck, zero=1))
    _assert_same_weights(other["loaded"], full["snap"])
    assert other["losses"] == pytest.approx(full["losses"][SAVE_AT:], rel=1e-5)
