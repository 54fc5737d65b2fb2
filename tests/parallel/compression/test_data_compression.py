"""Compression inside data parallelism, through ``parallelize`` and a user's own loop.

* Exact methods (top-k with rho = 1, PowerSGD at full rank) under dp2 (with gradient
  accumulation), dp2 x tp2 and pp2 x dp2 match plain PyTorch on one process: losses
  and pre-clip gradient norms at every step (rtol 1e-9) and every weight after the
  last step (rtol 1e-9, atol 1e-11) — the protocol and tolerances of
  ``tests/parallel/test_parallelize.py``, whose reference and batches this reuses.
  Compression applies over dp only; tp and pp are untouched. PowerSGD runs with SGD
  rather than AdamW: its QR leaves rounding noise (~1e-17) where the true gradient is
  exactly zero (embedding rows of tokens absent from the batch), and Adam divides that
  noise by its own square root, turning it into a full-size step; SGD keeps it at
  1e-17 x lr, so the comparison stays a test of the reduction.
* Lossy methods with one bucket per parameter (many small collectives) on 2 and 4
  ranks finish (a hang would trip the pool's 60 s comm timeout), keep the replicas
  bit-identical, and communicate only on the last micro-step of an accumulation.
* ``compression_start`` plain steps come first.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.config import ParallelConfig
from plait.optim import Optimizer
from plait.parallel.compression import Compressor, PowerSGDCompressor, TopKCompressor
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext
from tests.parallel.test_parallelize import (
    BATCH,
    CLIP,
    LR,
    MODELS,
    PIPELINE_MICROBATCHES,
    RTOL,
    VOCAB,
    Pools,
    _batches,
    _reference,
    assemble,
    train_one_process,
)

ATOL = 1e-11
SGD_LR = 0.5


def _optimizer(params: Any, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR)
    return torch.optim.AdamW(params, lr=LR)


def _reference_sgd() -> dict[str, Any]:
    """Plain PyTorch on one process with SGD and clipping (cf. ``_reference``)."""
    model = MODELS["builtin"]()
    opt = _optimizer(model.parameters(), "sgd")
    losses, norms = train_one_process(model, opt, _batches(), VOCAB)
    return {
        "losses": losses,
        "norms": norms,
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _compressor(name: str, start: int = 0) -> Compressor:
    if name == "topk1":
        return TopKCompressor(1.0, start)
    if name == "powersgd_full":
        return PowerSGDCompressor(rank=1024, start=start, min_compression_rate=0.0)
    if name == "topk":
        return TopKCompressor(0.05, start)
    if name == "powersgd":
        return PowerSGDCompressor(rank=1, start=start, min_compression_rate=0.0)
    raise KeyError(name)


def _body(
    ctx: WorkerContext, name: str, dp: int, tp: int, pp: int, micro: int, kind: str
) -> dict[str, Any]:
    mesh = ctx.mesh(dp=dp, tp=tp, pp=pp)
    cfg = ParallelConfig(microbatches=PIPELINE_MICROBATCHES, bucket_mb=0.01)
    pm = parallelize(MODELS["builtin"](), mesh, cfg, compressor=_compressor(name))
    assert pm.compressor is not None and name.split("_")[0].rstrip("1") in pm.describe()
    opt = Optimizer(pm, _optimizer(pm.parameters(), kind), max_norm=CLIP)
    per, r = BATCH // dp, mesh.index("dp")
    losses, norms = [], []
    for x, y in _batches():
        xr, yr = x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]
        losses.append(float(pm.step(xr, yr, micro_batches=micro)))
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
    pieces = [
        (p.name, list(p.shape), p.tp, p.start, p.end, p.value.detach().cpu().clone())
        for p in opt.local_pieces()
        if p.write
    ]
    return {"losses": losses, "norms": norms, "pieces": pieces}


@pytest.fixture(scope="module")
def refs() -> dict[str, Any]:
    return {"adamw": _reference("builtin"), "sgd": _reference_sgd()}


@pytest.mark.parametrize(
    ("name", "world", "dp", "tp", "pp", "micro"),
    [
        pytest.param("topk1", 2, 2, 1, 1, 2, id="topk1-dp2-accum2"),
        pytest.param("powersgd_full", 2, 2, 1, 1, 1, id="powersgd_full-dp2"),
        pytest.param("powersgd_full", 4, 2, 2, 1, 1, id="powersgd_full-dp2xtp2"),
        pytest.param("topk1", 4, 2, 1, 2, PIPELINE_MICROBATCHES, id="topk1-pp2xdp2"),
    ],
)
def test_exact_compression_matches_one_process(
    pools: Pools, refs: dict[str, Any], name: str, world: int, dp: int, tp: int, pp: int,
    micro: int,
) -> None:
    kind = "sgd" if name.startswith("powersgd") else "adamw"
    ref = refs[kind]
    results = pools(world).run(_body, name, dp, tp, pp, micro, kind)
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(ref["losses"], rel=RTOL), f"rank {rank} losses"
        assert r["norms"] == pytest.approx(ref["norms"], rel=RTOL), f"rank {rank} norms"
    got = assemble([p for r in results for p in r["pieces"]])
    for n, want in ref["weights"].items():
        torch.testing.assert_close(got[n], want, rtol=RTOL, atol=ATOL, msg=n)


def _body_small_buckets(
    ctx: WorkerContext, name: str, start: int, micro: int
) -> dict[str, Any]:
    mesh = ctx.mesh(dp=ctx.world_size)
    cfg = ParallelConfig(bucket_mb=1e-6)  # one bucket per parameter: many collectives
    pm = parallelize(MODELS["builtin"](), mesh, cfg, compressor=_compressor(name, start))
    opt = Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=LR), max_norm=CLIP)
    per, r = BATCH // mesh.size("dp"), mesh.index("dp")
    n_buckets = len(pm.module.buckets)  # type: ignore[union-attr]
    calls: list[dict[str, int]] = []
    losses = []
    for x, y in _batches()[:3]:
        mesh.stats.reset()
        xr, yr = x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]
        losses.append(float(pm.step(xr, yr, micro_batches=micro)))
        calls.append(
            {op: mesh.stats.get("dp", op).calls for op in ("all_reduce", "all_gather")}
        )
        opt.step()
        opt.zero_grad()
    weights = {n: p.detach().clone() for n, p in pm.named_parameters()}
    return {"buckets": n_buckets, "calls": calls, "losses": losses, "weights": weights}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["topk", "powersgd"])
def test_many_small_buckets_do_not_hang_and_replicas_agree(
    pools: Pools, world: int, name: str
) -> None:
    start, micro = 1, 2
    results = pools(world).run(_body_small_buckets, name, start, micro)
    first = results[0]
    nb = first["buckets"]
    assert nb > 20
    for step, c in enumerate(first["calls"]):
        # two all-reduces per step (the count of target tokens and the loss:
        # parallel/token_weight.py), and per bucket: plain all-reduce during warm-up;
        # then top-k all-gathers, or PowerSGD's P and Q rounds (every parameter of this
        # model is a matrix or a vector)
        if step < start:
            assert c == {"all_reduce": nb + 2, "all_gather": 0}, c
        elif name == "topk":
            assert c == {"all_reduce": 2, "all_gather": nb}, c
        else:
            assert c["all_gather"] == 0 and nb + 2 < c["all_reduce"] <= 3 * nb + 2, c
    for r in results[1:]:
        assert r["losses"] == first["losses"]
        for k, w in first["weights"].items():
            assert torch.equal(r["weights"][k], w), k  # replicas stay bit-identical
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in results)


def test_refused_outside_plain_data_parallelism() -> None:
    from plait import init_mesh
    from plait.errors import ConfigError

    with pytest.raises(ConfigError, match="plain data parallelism"):
        parallelize(MODELS["builtin"](), init_mesh(), zero=1, compressor=TopKCompressor(0.1))
    with pytest.raises(ConfigError, match="plain data parallelism"):
        parallelize(MODELS["builtin"](), init_mesh(), precision="bf16",
                    compressor=TopKCompressor(0.1))
