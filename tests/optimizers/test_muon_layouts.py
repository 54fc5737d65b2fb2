"""Muon through ``parallelize`` on the MoE model under expert parallelism (expert
units with their own shard groups under ZeRO, owners over ``ep_replica``) equals one
process (float64, Newton-Schulz in float64; the protocol and model of
tests/parallel/expert/test_expert_parallel.py: losses and pre-clip norms every step,
weights after the last step rebuilt from ``local_pieces()``, rtol 1e-9)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plait.config import Config, ParallelConfig
from plait.optim import Optimizer
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext
from plait.train.matrix_optim import make_muon
from tests.parallel.expert.test_expert_parallel import BATCH, VOCAB, _batches, _model, _moes
from tests.parallel.test_parallelize import ATOL, CLIP, RTOL, Piece, Pools, assemble

M = "tests.optimizers.test_muon_layouts"


def _cfg() -> Config:
    cfg = Config()
    cfg.train.optimizer, cfg.train.lr = "muon", 1e-3
    cfg.optim.muon_lr, cfg.optim.muon_ns_dtype = 0.02, "float64"
    return cfg


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    """One process, the whole global batch."""
    model = _model()
    opt = Optimizer(model, make_muon(model, _cfg(), 1e-3), max_norm=CLIP)
    for moe in _moes(model):
        moe.grad_scale = 1.0
    losses, norms = [], []
    for x, y in _batches():
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "weights": dict(model.named_parameters())}


def _body(ctx: WorkerContext, ep: int, zero: int, pp: int) -> dict[str, Any]:
    dp = ctx.world_size // pp
    mesh = ctx.mesh(dp=dp, pp=pp)
    pcfg = ParallelConfig(ep=ep, zero=zero, microbatches=2 if pp > 1 else None)
    pm = parallelize(_model(), mesh, pcfg)
    opt = Optimizer(pm, make_muon(pm, _cfg(), 1e-3), max_norm=CLIP)
    per, r = BATCH // dp, mesh.index("dp")
    losses, norms = [], []
    for x, y in _batches():
        losses.append(float(pm.step(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])))
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
    pieces: list[Piece] = [
        (p.name, list(p.shape), p.tp, p.start, p.end, p.value.detach().cpu().clone())
        for p in opt.local_pieces()
        if p.write
    ]
    return {"losses": losses, "norms": norms, "pieces": pieces}


@pytest.mark.parametrize(
    ("world", "ep", "zero", "pp"),
    [
        pytest.param(2, 2, 2, 1, id="ep2-zero2"),
        pytest.param(4, 2, 3, 1, id="dp2xep2-zero3"),
    ],
)
def test_muon_layouts_equal_one_process(
    pools: Pools, ref: dict[str, Any], world: int, ep: int, zero: int, pp: int
) -> None:
    results = pools(world).run(f"{M}:_body", ep, zero, pp)
    for res in results:
        if res["losses"]:
            torch.testing.assert_close(res["losses"], ref["losses"], rtol=RTOL, atol=0)
        torch.testing.assert_close(res["norms"], ref["norms"], rtol=RTOL, atol=0)
    weights = assemble([p for res in results for p in res["pieces"]])
    assert sorted(weights) == sorted(ref["weights"])
    for name, want in ref["weights"].items():
        torch.testing.assert_close(weights[name], want.detach(), rtol=RTOL, atol=ATOL, msg=name)
