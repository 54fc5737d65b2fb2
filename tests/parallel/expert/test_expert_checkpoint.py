"""Checkpoints under expert parallelism: bit-exact resume, resharding between ep degrees.

The protocol of ``tests/checkpoint/test_checkpoint.py`` with an MoE transformer (2
layers, 4 experts top-2): a run trains 6 steps saving at step 3 and a second run resumes.
Under the same layout (ep2, with and without ZeRO-3: the expert weights then in units
of their own over the expert replica group) the resumed losses and final weights equal
the uninterrupted run's bit for bit. Under another layout (ep2 -> ep1 on one process,
ep1 on one process -> ep4, ep2 ZeRO-3 -> ep1, dp2 x ep2 -> ep2 ZeRO-2) the weights right
after loading equal the source's full weights at step 3 exactly (expert weights
gathered over the ep group independently of the checkpoint
code), and the losses of steps 4-6 match to rtol 1e-5 (other summation order).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from plait import comm
from plait.checkpoint import step_dirname
from plait.config import Config, ModelConfig, ParallelConfig
from plait.parallel.expert import expert_split
from plait.testing import WorkerContext, WorkerPool
from plait.train.trainer import Trainer
from tests.checkpoint.test_checkpoint import SAVE_AT, config
from tests.checkpoint.test_checkpoint import _train as train_and_snapshot

M = "tests.parallel.expert.test_expert_checkpoint"
MOE = dict(moe_experts=4, moe_top_k=2, moe_hidden_dim=32)


def moe_config(root: str | None, ep: int, resume: str | None = None, zero: int = 0) -> Config:
    cfg = config(root, resume=resume)
    model = dataclasses.asdict(cfg.model) | MOE
    parallel = ParallelConfig(ep=ep, zero=zero)
    return dataclasses.replace(cfg, model=ModelConfig(**model), parallel=parallel)


def full_weights(tr: Trainer) -> dict[str, torch.Tensor]:
    """One-device weights: expert weights all-gathered over the ep group (ZeRO: the
    units gathered first)."""
    out = {}
    zero = tr.model.zero
    with zero.gathered() if zero is not None else contextlib.nullcontext():
        for n, p in tr.base.named_parameters():
            t = p.detach().clone()
            s = expert_split(p)
            if s is not None and s.shards > 1:
                g = tr.model.experts.ep_group
                t = comm.all_gather(t.contiguous(), g)  # (E, ...) along dim 0
            out[n] = t
    return out


def _train(ctx: WorkerContext | None, cfg: Config, weights_at: int | None = None) -> Any:
    return train_and_snapshot(ctx, cfg, weights_at=weights_at, weights=full_weights)


def _body(ctx: WorkerContext, cfg: Config, weights_at: int | None = None) -> Any:
    return _train(ctx, cfg, weights_at)


def _run(pools: Callable[[int], WorkerPool], world: int, cfg: Config, **kw: Any) -> Any:
    if world == 1:
        return _train(None, cfg, **kw)
    results = pools(world).run(f"{M}:_body", cfg, **kw)
    for r in results[1:]:  # every rank ends with the same full weights and losses
        assert r["losses"] == results[0]["losses"]
        for k in ("loaded", "snap", "final"):
            assert all(torch.equal(r[k][n], t) for n, t in results[0][k].items())
    return results[0]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("zero", [0, 3])
def test_resume_is_bit_exact_ep2(
    pools: Callable[[int], WorkerPool], tmp_path: Path, zero: int
) -> None:
    root = str(tmp_path / "ck")
    full = _run(pools, 2, moe_config(root, 2, zero=zero))
    ck = str(Path(root) / step_dirname(SAVE_AT))
    resumed = _run(pools, 2, moe_config(root, 2, resume=ck, zero=zero))
    assert resumed["start"] == SAVE_AT
    assert resumed["losses"] == full["losses"][SAVE_AT:]
    _same(resumed["final"], full["final"])


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        pytest.param((2, 2, 0), (1, 1, 0), id="ep2->ep1"),
        pytest.param((1, 1, 0), (4, 4, 0), id="ep1->ep4"),
        pytest.param((2, 2, 3), (1, 1, 0), id="ep2-zero3->ep1"),
        pytest.param((4, 2, 0), (2, 2, 2), id="dp2xep2->ep2-zero2"),
    ],
)
def test_reshard_between_ep_degrees(
    pools: Callable[[int], WorkerPool],
    tmp_path: Path,
    src: tuple[int, int, int],
    dst: tuple[int, int, int],
) -> None:
    root = str(tmp_path / "ck")
    a = _run(pools, src[0], moe_config(root, src[1], zero=src[2]), weights_at=SAVE_AT)
    ck = str(Path(root) / step_dirname(SAVE_AT))
    b = _run(pools, dst[0], moe_config(None, dst[1], resume=ck, zero=dst[2]))
    assert b["start"] == SAVE_AT
    _same(b["loaded"], a["snap"])
    assert b["losses"] == pytest.approx(a["losses"][SAVE_AT:], rel=1e-5)
