"""Muon and Adafactor through ``parallelize`` equal one process (float64, Newton-Schulz in
float64; losses and pre-clip norms every step, weights after the last step rebuilt from
``local_pieces()``, rtol 1e-9):

* on the MoE model under expert parallelism (expert units with their own shard groups
  under ZeRO; Muon's owners over ``ep_replica``, Adafactor's sums over ep): the protocol
  and model of tests/parallel/expert/test_expert_parallel.py;
* on the dense built-in model (2 layers, 3 steps) under pipeline parallelism (pp2, 1F1B
  over 2 micro-batches; pp2 x dp2 with ZeRO-1): the protocol of
  tests/parallel/test_parallelize.py.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plait.config import Config, ParallelConfig
from plait.model import Transformer
from plait.optim import Optimizer
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext
from plait.train.matrix_optim import make_adafactor, make_muon
from tests.parallel.expert.test_expert_parallel import BATCH, VOCAB, _batches, _model, _moes
from tests.parallel.test_parallelize import ATOL, CFG, CLIP, RTOL, Piece, Pools, assemble
from tests.parallel.test_parallelize import BATCH as DENSE_BATCH
from tests.parallel.test_parallelize import _batches as _all_dense_batches

DENSE = replace(CFG, n_layers=2)
"""The dense model of the pipeline tests: one block per stage."""


def _dense() -> Transformer:
    return Transformer(DENSE, seed=3).double()


def _dense_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return _all_dense_batches()[:3]


M = "tests.optimizers.test_muon_layouts"


def _cfg(optimizer: str = "muon") -> Config:
    cfg = Config()
    cfg.train.optimizer, cfg.train.lr = optimizer, 1e-3  # type: ignore[assignment]
    cfg.optim.muon_lr, cfg.optim.muon_ns_dtype = 0.02, "float64"
    return cfg


def _optimizer(model: torch.nn.Module, optimizer: str) -> torch.optim.Optimizer:
    make = make_muon if optimizer == "muon" else make_adafactor
    return make(model, _cfg(optimizer), 1e-3)


def _one_process(model: torch.nn.Module, optimizer: str, batches: Any) -> dict[str, Any]:
    """One process, the whole global batch: losses and pre-clip norms, final weights."""
    opt = Optimizer(model, _optimizer(model, optimizer), max_norm=CLIP)
    losses, norms = [], []
    for x, y in batches:
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "weights": dict(model.named_parameters())}


@pytest.fixture(scope="module")
def ref() -> dict[str, dict[str, Any]]:
    """One process on the MoE model, per optimizer (computed on first use)."""
    return {}


def _moe_reference(cache: dict[str, dict[str, Any]], optimizer: str) -> dict[str, Any]:
    if optimizer not in cache:
        model = _model()
        for moe in _moes(model):
            moe.grad_scale = 1.0
        cache[optimizer] = _one_process(model, optimizer, _batches())
    return cache[optimizer]


def _body(
    ctx: WorkerContext, ep: int, zero: int, pp: int, optimizer: str, dense: bool
) -> dict[str, Any]:
    dp = ctx.world_size // pp
    mesh = ctx.mesh(dp=dp, pp=pp)
    micro = 2 if pp > 1 else None
    pcfg = ParallelConfig(ep=ep, zero=zero, microbatches=micro, pipeline_schedule="1f1b")
    pm = parallelize(_dense() if dense else _model(), mesh, pcfg)
    opt = Optimizer(pm, _optimizer(pm, optimizer), max_norm=CLIP)
    per, r = (DENSE_BATCH if dense else BATCH) // dp, mesh.index("dp")
    losses, norms = [], []
    for x, y in _dense_batches() if dense else _batches():
        losses.append(float(pm.step(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])))
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
    pieces: list[Piece] = [
        (p.name, list(p.shape), p.tp, p.start, p.end, p.value.detach().cpu().clone())
        for p in opt.local_pieces()
        if p.write
    ]
    return {"losses": losses, "norms": norms, "pieces": pieces}


def _compare(results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    for res in results:
        if res["losses"]:
            torch.testing.assert_close(res["losses"], ref["losses"], rtol=RTOL, atol=0)
        torch.testing.assert_close(res["norms"], ref["norms"], rtol=RTOL, atol=0)
    weights = assemble([p for res in results for p in res["pieces"]])
    assert sorted(weights) == sorted(ref["weights"])
    for name, want in ref["weights"].items():
        torch.testing.assert_close(weights[name], want.detach(), rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize(
    ("optimizer", "world", "ep", "zero"),
    [
        pytest.param("muon", 2, 2, 2, id="muon-ep2-zero2"),
        pytest.param("muon", 4, 2, 3, id="muon-dp2xep2-zero3"),
        pytest.param("adafactor", 2, 2, 2, id="adafactor-ep2-zero2"),
    ],
)
def test_expert_layouts_equal_one_process(
    pools: Pools, ref: dict[str, dict[str, Any]], optimizer: str, world: int, ep: int, zero: int
) -> None:
    results = pools(world).run(f"{M}:_body", ep, zero, 1, optimizer, False)
    _compare(results, _moe_reference(ref, optimizer))


@pytest.mark.parametrize("optimizer", ["muon", "adafactor"])
@pytest.mark.parametrize(
    ("world", "zero"), [pytest.param(2, 0, id="pp2"), pytest.param(4, 1, id="pp2xdp2-zero1")]
)
def test_pipeline_equals_one_process(pools: Pools, optimizer: str, world: int, zero: int) -> None:
    """pp2 (1F1B, 2 micro-batches) and pp2 x dp2 under ZeRO-1: each stage steps its own
    matrices whole (Muon) or reduces their sums over its shard group (Adafactor)."""
    _compare(pools(world).run(f"{M}:_body", 1, zero, 2, optimizer, True), _dense_ref(optimizer))


@functools.cache  # one run for both layouts (read, never changed)
def _dense_ref(optimizer: str) -> dict[str, Any]:
    return _one_process(_dense(), optimizer, _dense_batches())
