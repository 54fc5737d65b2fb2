"""Checkpoints under expert parallelism: bit-exact resume, resharding between ep degrees.

The protocol of ``tests/checkpoint/test_checkpoint.py`` with an MoE transformer (2
layers, 4 experts top-2): a run trains 6 steps saving at step 3 and a second run resumes.
Under the same layout (ep2) the resumed losses and final weights equal the uninterrupted
run's bit for bit. Under another ep degree (ep2 -> ep1 on one process, ep1 on one
process -> ep4) the weights right after loading equal the source's full weights at step
3 exactly (expert weights gathered over the ep group independently of the checkpoint
code), and the losses of steps 4-6 match to rtol 1e-5 (other summation order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from plait import comm, init_mesh
from plait.checkpoint import TrainState, step_dirname
from plait.config import Config, ModelConfig, ParallelConfig
from plait.parallel.expert import expert_split
from plait.testing import WorkerContext, WorkerPool
from plait.train.trainer import Trainer
from tests.checkpoint.test_checkpoint import SAVE_AT, config

M = "tests.parallel.expert.test_expert_checkpoint"
MOE = dict(moe_experts=4, moe_top_k=2, moe_hidden_dim=32)


def moe_config(root: str | None, ep: int, resume: str | None = None) -> Config:
    cfg = config(root, resume=resume)
    model = dataclasses.asdict(cfg.model) | MOE
    return dataclasses.replace(cfg, model=ModelConfig(**model), parallel=ParallelConfig(ep=ep))


def full_weights(tr: Trainer) -> dict[str, torch.Tensor]:
    """One-device weights: expert weights all-gathered over the ep group."""
    out = {}
    for n, p in tr.base.named_parameters():
        t = p.detach().clone()
        s = expert_split(p)
        if s is not None and s.shards > 1:
            g = tr.model.experts.ep_group
            t = comm.all_gather(t.contiguous(), g)  # (E, ...) along dim 0
        out[n] = t
    return out


def _train(ctx: WorkerContext | None, cfg: Config, weights_at: int | None = None) -> Any:
    mesh = init_mesh() if ctx is None else ctx.mesh(dp=ctx.world_size)
    tr = Trainer(cfg, mesh, show_progress=False)
    start, loaded, snap = tr.start_step, full_weights(tr), {}
    if weights_at is not None:
        after = tr.checkpoints.after_step

        def after_step(state: TrainState, done: int, last: int, stop: bool) -> Any:
            if done == weights_at:
                snap.update(full_weights(tr))
            return after(state, done, last, stop)

        tr.checkpoints.after_step = after_step  # type: ignore[method-assign]
    losses = tr.run().losses
    return {
        "start": start,
        "losses": losses,
        "loaded": loaded,
        "snap": snap,
        "final": full_weights(tr),
    }


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


def test_resume_is_bit_exact_ep2(pools: Callable[[int], WorkerPool], tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    full = _run(pools, 2, moe_config(root, 2))
    ck = str(Path(root) / step_dirname(SAVE_AT))
    resumed = _run(pools, 2, moe_config(root, 2, resume=ck))
    assert resumed["start"] == SAVE_AT
    assert resumed["losses"] == full["losses"][SAVE_AT:]
    _same(resumed["final"], full["final"])


@pytest.mark.parametrize(
    ("src", "dst"),
    [pytest.param((2, 2), (1, 1), id="ep2->ep1"), pytest.param((1, 1), (4, 4), id="ep1->ep4")],
)
def test_reshard_between_ep_degrees(
    pools: Callable[[int], WorkerPool], tmp_path: Path, src: tuple[int, int], dst: tuple[int, int]
) -> None:
    root = str(tmp_path / "ck")
    a = _run(pools, src[0], moe_config(root, src[1]), weights_at=SAVE_AT)
    ck = str(Path(root) / step_dirname(SAVE_AT))
    b = _run(pools, dst[0], moe_config(None, dst[1], resume=ck))
    assert b["start"] == SAVE_AT
    _same(b["loaded"], a["snap"])
    assert b["losses"] == pytest.approx(a["losses"][SAVE_AT:], rel=1e-5)
