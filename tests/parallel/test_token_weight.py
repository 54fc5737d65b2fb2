"""Token-weighted loss: every layout equals one process running the whole global batch.

The global batch has ignored targets (``-100``) spread unevenly over its rows and
positions, so its micro-batches, pipeline micro-batches, cp shards and data ranks count
different numbers of targets. The reference is one process on the whole batch:
``F.cross_entropy(..., ignore_index=-100)`` (the sum over counted targets / their
number), backward, one SGD step at lr 1 (so the updated weights are ``w - grad``).
Each layout's ``pm.step`` loss and updated weights (rebuilt from ``local_pieces()``)
must equal it in float64 (rtol 1e-10, atol 1e-12: the layouts differ from the reference
only in summation order, ~1e-15), and the old mean of the four quarter-batch means is
shown to differ from it by far more (> 1e-4 relative in the loss, > 1e-5 in some
weight) in the same test. ``evaluate`` gives the
same loss, and its data-axis traffic is exactly the count's all-reduce plus the loss's
(2 x 8 bytes), the bus-byte formula of an all-reduce; so is a ZeRO-3 step's (its
gradients are reduce-scattered, so those are its only all-reduces).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plait.comm import bus_bytes
from plait.config import ModelConfig, ParallelConfig
from plait.model import Transformer
from plait.optim import Optimizer
from plait.parallel.model import data_axes
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext, WorkerPool
from tests.parallel.test_parallelize import assemble

Pools = Callable[[int], WorkerPool]
BATCH, SEQ, VOCAB, DIM, LR = 8, 16, 64, 32, 1.0
RTOL, ATOL = 1e-10, 1e-12
CFG = ModelConfig(vocab_size=VOCAB, dim=DIM, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
IGNORED_PER_ROW = [0, 15, 3, 12, 9, 0, 14, 6]  # counted targets per row: 16 .. 1


def _model() -> torch.nn.Module:
    return Transformer(CFG, seed=3).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """One global batch ``(BATCH, SEQ)``: row i has ``IGNORED_PER_ROW[i]`` ignored
    targets at seeded positions (so cp shards count unevenly too)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    for row, k in enumerate(IGNORED_PER_ROW):
        y[row, torch.randperm(SEQ, generator=g)[:k]] = -100
    return x, y


def _one_process(quarters: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and weights after one SGD step on one process: the token-weighted loss of
    the whole batch, or (``quarters``) the old mean of the four quarter-batch means."""
    model = _model()
    x, y = _batch()
    if quarters:
        parts = zip(x.chunk(4), y.chunk(4), strict=True)
        loss = sum(F.cross_entropy(model(a).reshape(-1, VOCAB), b.reshape(-1)) for a, b in parts)
        loss = loss / 4
    else:
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return loss.item(), {n: p.detach().clone() for n, p in model.named_parameters()}


def _body(ctx: WorkerContext, layout: dict[str, Any]) -> dict[str, Any]:
    """One step of the layout on one rank: its loss, evaluate's loss and data-axis
    all-reduce traffic, and its written pieces after one SGD step."""
    dp, tp, pp, cp = (layout.get(k, 1) for k in ("dp", "tp", "pp", "cp"))
    mesh = ctx.mesh(dp=dp, tp=tp, pp=pp, cp=cp)
    cfg = ParallelConfig(
        microbatches=4,
        pipeline_schedule=layout.get("schedule", "1f1b"),
        chunks=layout.get("chunks", 1),
        cp_attention=layout.get("cp_attention", "ring"),
        bucket_mb=0.01,
    )
    pm = parallelize(_model(), mesh, cfg, zero=layout.get("zero", 0))
    opt = Optimizer(pm, torch.optim.SGD(pm.parameters(), lr=LR))
    x, y = _batch()
    per, r = BATCH // dp, mesh.index("dp")
    xr, yr = x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]
    group = mesh.axis(*data_axes(mesh))
    mesh.stats.reset()
    evaluated = float(pm.evaluate(xr, yr))
    traffic = mesh.stats.get(group.name, "all_reduce")
    mesh.stats.reset()
    loss = float(pm.step(xr, yr, micro_batches=layout.get("micro", 1)))
    in_step = mesh.stats.get(group.name, "all_reduce")
    opt.step()
    pieces = [
        (p.name, list(p.shape), p.tp, p.start, p.end, p.value.detach().cpu().clone())
        for p in opt.local_pieces()
        if p.write
    ]
    return {
        "loss": loss,
        "evaluated": evaluated,
        "calls": traffic.calls,
        "bytes": traffic.bytes,
        "step_calls": in_step.calls,
        "step_bytes": in_step.bytes,
        "group": group.size,
        "pieces": pieces,
    }


@pytest.fixture(scope="module")
def refs() -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
    return {"tokens": _one_process(False), "quarters": _one_process(True)}


LAYOUTS = [
    pytest.param({"dp": 2, "micro": 2}, id="dp2-accum2"),
    pytest.param({"dp": 2, "micro": 2, "zero": 3}, id="zero3-dp2-accum2"),
    pytest.param({"dp": 2, "zero": 1}, id="zero1-dp2"),
    pytest.param({"tp": 2, "micro": 2}, id="tp2-accum2"),
    pytest.param({"pp": 2}, id="pp2-1f1b-m4"),
    pytest.param({"pp": 2, "schedule": "interleaved", "chunks": 2}, id="pp2-interleaved"),
    pytest.param({"pp": 2, "schedule": "zb"}, id="pp2-zb"),
    pytest.param({"cp": 2, "micro": 2}, id="cp2-ring-accum2"),
    pytest.param({"cp": 2, "cp_attention": "ulysses"}, id="cp2-ulysses"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_weighted_step_matches_one_process(
    pools: Pools, refs: dict[str, tuple[float, dict[str, torch.Tensor]]], layout: dict[str, Any]
) -> None:
    """Loss (step and evaluate) and updated weights equal the one-process token-weighted
    step (rtol 1e-10) and differ from the old mean of micro-batch means; the
    count costs one 8-byte all-reduce over the data axes."""
    want_loss, want = refs["tokens"]
    old_loss, old = refs["quarters"]
    assert abs(old_loss - want_loss) > 1e-4 * want_loss  # the old weighting differs
    assert max((old[n] - w).abs().max().item() for n, w in want.items()) > 1e-5
    results = pools(2).run(_body, layout)
    for rank, res in enumerate(results):
        assert res["loss"] == pytest.approx(want_loss, rel=RTOL), f"rank {rank}"
        assert res["evaluated"] == pytest.approx(want_loss, rel=RTOL), f"rank {rank}"
        # evaluate: the count's all-reduce and the loss's, 8 float64 bytes each
        assert res["calls"] == 2
        assert res["bytes"] == 2 * bus_bytes("all_reduce", 8, res["group"])
        if layout.get("zero") == 3:  # gradients reduce-scatter: the step's all-reduces too
            assert (res["step_calls"], res["step_bytes"]) == (res["calls"], res["bytes"])
    got = assemble([p for res in results for p in res["pieces"]])
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=RTOL, atol=ATOL, msg=name)
