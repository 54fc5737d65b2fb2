"""Sequence parallelism with MoE layers, against one process (float64, rtol 1e-9).

Under Megatron sequence parallelism the activations between the tensor-parallel regions
are split along the sequence over tp; an MoE layer is no region: each tp rank routes its
own sequence shard (its ep group is at its tp index), only the shared experts gather
the sequence. The protocol of ``test_expert_parallel.py`` (its float64 one-process
reference): the loss and pre-clip gradient norm at every step (clipping bites), the
load-balancing loss of every MoE layer at every step (each rank's is of its sequence
shard; the mean over dp x tp is the global batch's), every weight after 5 steps from
``local_pieces()``. Layouts: tp2 with SP (ep1, 2 ranks), ep2 x tp2 with SP (dp2 = ep2,
4 ranks), the same with ZeRO-3, and with transformers' router options (``MOE_HF``:
the sigmoid-gated shared expert, whose gate sees the rank's sequence shard like the
router, and the model-wide load-balancing loss over the counts of every token shard).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait import comm
from plait.config import ParallelConfig
from plait.optim import Optimizer
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext
from tests.parallel.expert.test_expert_parallel import (
    MODELS,
    SEQ,
    _batches,
    _model,
    _reference,
)
from tests.parallel.test_parallelize import ATOL, CLIP, LR, RTOL, Piece, Pools, assemble


def _body(ctx: WorkerContext, ep: int, tp: int, zero: int, model: str) -> dict[str, Any]:
    dp = ctx.world_size // tp
    mesh = ctx.mesh(dp=dp, tp=tp)
    cfg = ParallelConfig(ep=ep, zero=zero, sequence_parallel=True, bucket_mb=0.01)
    pm = parallelize(_model(MODELS[model]), mesh, cfg)
    opt = Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=LR), max_norm=CLIP)
    per, r = _batches()[0][0].shape[0] // dp, mesh.index("dp")
    assert pm.experts is not None and pm.experts.seq_split == tp
    seen: list[int] = []  # the sequence length an MoE layer routes: its shard
    pm.experts.moes[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
    losses, norms, aux = [], [], []
    for x, y in _batches():
        xr, yr = x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]
        losses.append(float(pm.step(xr, yr)))
        rank_aux = torch.tensor(
            [float(s.aux_loss) for s in pm.experts.stats()], dtype=torch.float64
        )
        comm.all_reduce(rank_aux, mesh.axis("dp", "tp"), op="avg")  # over every token shard
        aux.append(rank_aux.tolist())
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
    pieces: list[Piece] = [
        (p.name, list(p.shape), p.tp, p.start, p.end, p.value.detach().cpu().clone())
        for p in opt.local_pieces()
        if p.write
    ]
    summary = pm.moe_summary()
    assert seen and set(seen) == {SEQ // tp}
    return {"losses": losses, "norms": norms, "aux": aux, "pieces": pieces, "summary": summary}


@pytest.mark.parametrize(
    ("world", "ep", "tp", "zero", "model"),
    [
        pytest.param(2, 1, 2, 0, "plait", id="tp2-sp"),
        pytest.param(4, 2, 2, 0, "plait", id="ep2xtp2-sp"),
        pytest.param(4, 2, 2, 3, "plait", id="ep2xtp2-sp-zero3"),
        pytest.param(4, 2, 2, 3, "hf", id="ep2xtp2-sp-zero3-hf-router"),
    ],
)
def test_sequence_parallel_with_moe_matches_one_process(
    pools: Pools, world: int, ep: int, tp: int, zero: int, model: str
) -> None:
    ref = _reference(1, 1, MODELS[model])
    assert min(ref["norms"]) > CLIP  # clipping bites at every step
    body = "tests.parallel.expert.test_expert_sp:_body"
    results = pools(world).run(body, ep, tp, zero, model)
    for res in results:
        torch.testing.assert_close(res["losses"], ref["losses"], rtol=RTOL, atol=0)
        torch.testing.assert_close(res["norms"], ref["norms"], rtol=RTOL, atol=0)
        torch.testing.assert_close(res["aux"], ref["aux"], rtol=RTOL, atol=0)
        # the metrics' figure: the same on every rank, the global batch's (last step)
        want = sum(ref["aux"][-1]) / len(ref["aux"][-1])
        assert res["summary"]["moe_aux_loss"] == pytest.approx(want, rel=RTOL)
    weights = assemble([p for res in results for p in res["pieces"]])
    assert sorted(weights) == sorted(ref["weights"])
    for name, want_w in ref["weights"].items():
        torch.testing.assert_close(weights[name], want_w, rtol=RTOL, atol=ATOL, msg=name)
