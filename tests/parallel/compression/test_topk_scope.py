"""Top-k over a whole bucket (``parallel.compression_topk_scope = "bucket"``): the same
count as per-tensor top-k, picked as one top-k over every matrix entry of the bucket
(vectors whole); with Adam before the sparsification the dp2 reduction equals a
one-process reference of the same recursion; config and CLI wiring.

Tolerances: float64; reductions to 1e-12 against the written-out reference.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from plait import init_mesh
from plait.config import Config, ModelConfig, ParallelConfig
from plait.errors import ConfigError
from plait.model import Transformer
from plait.parallel.compression import LocalAdam, TopKCompressor
from plait.parallel.compression.topk import topk_count
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext, WorkerPool
from tests.parallel.compression.adam_reference import local_adam_updates
from tests.parallel.compression.test_topk_dgc import MATRICES, NUMEL, SHAPES, _grad

M = "tests.parallel.compression.test_topk_scope"
VECTORS = [(240, 10), (370, 7)]  # (offset, numel) of the vectors in the bucket


def _bucket_mask(acc: torch.Tensor, rho: float) -> torch.Tensor:
    """Written out: the vectors, and the sum_i ceil(rho * n_i) largest |acc| over the
    concatenated matrix entries of the bucket."""
    mask = torch.zeros(NUMEL, dtype=torch.bool)
    for off, size in VECTORS:
        mask[off : off + size] = True
    offsets = torch.cat([torch.arange(off, off + size) for off, size in MATRICES])
    k = sum(topk_count(size, rho) for _, size in MATRICES)
    mask[offsets[acc[offsets].abs().topk(k).indices]] = True
    return mask


def test_bucket_scope_spends_the_same_count_where_the_residual_is_largest() -> None:
    """One matrix scaled 100x: per tensor each matrix gets its own k_i; per bucket the
    loud matrix takes the whole budget, and the count (bytes) is the same."""
    x = _grad(0, 0)
    x[0:240] *= 100.0  # the first matrix is much larger
    group = init_mesh().axis("dp")
    sent = {}
    for scope in ("tensor", "bucket"):
        c = TopKCompressor(0.1, scope=scope)  # type: ignore[arg-type]
        c.keep_sent = True
        c.reduce(0, x.clone(), SHAPES, group)()
        sent[scope] = c.sent[0] != 0
    assert int(sent["tensor"].sum()) == int(sent["bucket"].sum()) == 24 + 10 + 12 + 7
    assert int(sent["tensor"][250:370].sum()) == 12
    assert int(sent["bucket"][250:370].sum()) == 0 and int(sent["bucket"][0:240].sum()) == 36
    assert torch.equal(sent["bucket"], _bucket_mask(x, 0.1))
    assert "one top-k per bucket" in TopKCompressor(0.1, scope="bucket").describe()
    with pytest.raises(ValueError, match="scope"):
        TopKCompressor(0.1, scope="layer")  # type: ignore[arg-type]


def _reference(grads: list[torch.Tensor], rho: float, n: int) -> list[torch.Tensor]:
    """One rank, written out: Adam's moments of its own gradient, u / n error-fed, the
    bucket-wide top-k of the matrix entries sent (vectors whole)."""
    e = torch.zeros(NUMEL, dtype=torch.float64)
    out = []
    for u in local_adam_updates(grads, n):
        acc = e + u
        mask = _bucket_mask(acc, rho)
        out.append(torch.where(mask, acc, torch.zeros_like(acc)))
        e = torch.where(mask, torch.zeros_like(acc), acc)
    return out


def _body(ctx: WorkerContext, steps: int) -> list[torch.Tensor]:
    group = ctx.mesh(dp=ctx.world_size).axis("dp")
    c = TopKCompressor(0.1, adam=LocalAdam(0.9, 0.95, 1e-8), scope="bucket")
    out = []
    for step in range(steps):
        flat = _grad(group.index, step) / group.size  # pre-divided, as buckets are
        flat[0:240] *= 1.0 + step  # the matrices' shares of the budget change over steps
        c.reduce(0, flat, SHAPES, group)()
        c.end_step()
        out.append(flat)
    return out


def test_adam_before_bucket_topk_matches_the_reference_at_dp2(
    pools: Callable[[int], WorkerPool],
) -> None:
    steps = 6
    results = pools(2).run(f"{M}:_body", steps)

    def grad(r: int, s: int) -> torch.Tensor:
        g = _grad(r, s)
        g[0:240] *= 1.0 + s
        return g

    refs = [_reference([grad(r, s) for s in range(steps)], 0.1, 2) for r in (0, 1)]
    for step in range(steps):
        want = refs[0][step] + refs[1][step]  # rank order, as the compressor adds
        for r in results:
            torch.testing.assert_close(r[step], want, rtol=1e-12, atol=1e-12)


def test_config_field_reaches_the_compressor() -> None:
    cfg = Config()
    cfg.model = ModelConfig(dim=32, n_layers=1, n_heads=4, max_seq_len=16)
    cfg.parallel.compression = "topk"
    cfg.parallel.compression_topk_scope = "bucket"
    pm = parallelize(Transformer(cfg.model, seed=0), init_mesh(), cfg)
    assert isinstance(pm.compressor, TopKCompressor) and pm.compressor.scope == "bucket"
    with pytest.raises(ConfigError, match="compression_topk_scope"):
        ParallelConfig(compression_topk_scope="layer")  # type: ignore[arg-type]
