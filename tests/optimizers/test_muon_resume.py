"""Muon's and Adafactor's state in checkpoints: resuming is bit-exact in one process and
under ZeRO-3 dp2 (Adafactor with bf16 weights and fp32 masters). Muon's momentum and
Adafactor's vector variance are element-wise state on each rank's shard pieces, saved
like AdamW's; Adafactor's row and column factors are whole-parameter state, the same on
every rank, saved with each piece and read whole: saved under ZeRO-3 dp2, a tp2 run
reads them back bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.checkpoint import CheckpointReader, step_dirname
from plait.config import Config
from plait.testing import WorkerContext, WorkerPool
from plait.train.trainer import Trainer
from tests.checkpoint.test_checkpoint import (
    SAVE_AT,
    _assert_same_weights,
    _mesh,
    _pool_run,
    config,
)

M = "tests.optimizers.test_muon_resume"
WQ = "layers.0.attention.wq.weight"


def _cfg(optimizer: str, root: str | None, resume: str | None = None, **kw: Any) -> Config:
    cfg = config(root, resume=resume, **kw)
    cfg.train.optimizer = optimizer  # type: ignore[assignment]
    cfg.optim.muon_lr = 0.02
    return cfg


@pytest.mark.parametrize(
    "optimizer, world, zero, dtype",
    [
        ("muon", 1, 0, "fp32"),
        ("muon", 2, 3, "fp32"),
        ("adafactor", 1, 0, "fp32"),
        ("adafactor", 2, 3, "bf16"),  # bf16 weights: Adafactor steps ZeRO's fp32 masters
    ],
)
def test_resume_is_bit_exact(
    pools: Callable[[int], WorkerPool],
    tmp_path: Path,
    optimizer: str,
    world: int,
    zero: int,
    dtype: str,
) -> None:
    root = str(tmp_path / "ck")
    full = _pool_run(pools, world, _cfg(optimizer, root, zero=zero, dtype=dtype))
    ck = Path(root) / step_dirname(SAVE_AT)
    meta = CheckpointReader(ck).meta["params"]
    pieces = meta[WQ]["pieces"]
    if optimizer == "muon":
        assert "momentum_buffer" in pieces[0]["keys"]
    else:  # the factors whole with every piece; a norm's variance per element
        assert {"row_var", "col_var", "step"} <= set(pieces[0]["scalars"])
        assert "variance" in meta["norm.weight"]["pieces"][0]["keys"]
    resumed = _pool_run(pools, world, _cfg(optimizer, root, resume=str(ck), zero=zero, dtype=dtype))
    assert resumed["start"] == SAVE_AT
    assert resumed["losses"] == full["losses"][SAVE_AT:]
    _assert_same_weights(resumed["final"], full["final"])


def _body_factors(ctx: WorkerContext, cfg: Config) -> dict[str, torch.Tensor]:
    """Adafactor's row and column factors of every matrix as this rank holds them after
    the run's start (a resume: as read from the checkpoint)."""
    tr = Trainer(cfg, _mesh(ctx, cfg), show_progress=False)
    out = {}
    for lp in tr.optimizer.local_pieces():
        state = tr.optimizer.state.get(lp.key, {})
        for k in ("row_var", "col_var"):
            if k in state:
                out[f"{lp.name}/{k}"] = state[k].detach().cpu().clone()
    return out


def test_adafactor_factors_reshard_zero3_dp2_to_tp2(
    pools: Callable[[int], WorkerPool], tmp_path: Path
) -> None:
    """Saved under ZeRO-3 dp2 (each rank's piece carries the same whole factors), read
    under tp2: every tp rank holds exactly the saved factors of each whole matrix."""
    root = str(tmp_path / "ck")
    _pool_run(pools, 2, _cfg("adafactor", root, steps=SAVE_AT, zero=3))
    ck = Path(root) / step_dirname(SAVE_AT)
    reader = CheckpointReader(ck)
    got = pools(2).run(f"{M}:_body_factors", _cfg("adafactor", None, resume=str(ck), tp=2))
    assert got[0].keys() == got[1].keys() and f"{WQ}/row_var" in got[0]
    for name, t in got[0].items():
        param, kind = name.rsplit("/", 1)
        saved = [
            reader.tensor(p["file"], p["scalars"][kind])
            for p in reader.meta["params"][param]["pieces"]
        ]
        assert all(torch.equal(s, saved[0]) for s in saved)  # the ranks agreed bit for bit
        assert torch.equal(t, saved[0]) and torch.equal(got[1][name], saved[0]), name
