"""Document masking under context parallelism against one process (float64).

Ring attention (zigzag and contiguous layouts, cp 2 and 4) and all-to-all attention
with the whole sequence's document ids equal SDPA with the block-causal boolean mask
(outputs and q/k/v gradients, 1e-10); the built-in model under cp2 ring attention with
``documents`` on trains like one process (losses, weights), its document ids gathered
over cp with the bytes of the formula.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plait.config import ParallelConfig
from plait.model.document_mask import DocumentIds, document_ids
from plait.parallel.context.layout import shard_sequence, unshard_sequence
from plait.parallel.context.ring_attention import RingAttention
from plait.parallel.context.ulysses_attention import UlyssesAttention
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext, WorkerPool
from tests.parallel.test_parallelize import BATCH, LR, SEQ, VOCAB, _builtin

Pools = Callable[[int], WorkerPool]
B, H, HK, S, D = 2, 4, 2, 16, 8
EOS = 0
TOL = dict(rtol=1e-10, atol=1e-12)
EOS_AT = [[2, 3, 9], [12]]  # per row; documents of one token and ones across chunks


def _full(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v, the output gradient ``(B, heads, S, D)`` float64 and doc ids ``(B, S)``."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    tokens = torch.ones(B, S, dtype=torch.long)
    for row, where in enumerate(EOS_AT):
        tokens[row, where] = EOS
    return r(B, H, S, D), r(B, HK, S, D), r(B, HK, S, D), r(B, H, S, D), document_ids(tokens, EOS)


def _body(ctx: WorkerContext, attn: str, layout: str, impl: str) -> dict[str, Any]:
    mesh = ctx.mesh(dp=1, cp=ctx.world_size)
    cp, me = mesh.size("cp"), mesh.index("cp")
    core = (
        RingAttention(mesh.axis("cp"), layout=layout, impl=impl)  # type: ignore[arg-type]
        if attn == "ring"
        else UlyssesAttention(mesh.axis("cp"))
    )
    q, k, v, dout, docs = _full()
    lay = layout if attn == "ring" else "contiguous"
    q, k, v, dout = (shard_sequence(t, lay, cp, me, dim=2) for t in (q, k, v, dout))  # type: ignore[arg-type]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = core(q, k, v, docs)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize(
    ("world", "attn", "layout", "impl"),
    [
        (2, "ring", "zigzag", "fused"),
        (4, "ring", "zigzag", "fused"),
        (2, "ring", "contiguous", "reference"),
        (2, "ulysses", "contiguous", "fused"),
    ],
)
def test_cp_attention_with_documents_matches_masked_sdpa(
    pools: Pools, world: int, attn: str, layout: str, impl: str
) -> None:
    results = pools(world).run(_body, attn, layout, impl)
    q, k, v, dout, docs = _full()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = (docs[:, None, :, None] == docs[:, None, None, :]) & torch.ones(S, S).tril().bool()
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask
    )
    ref.backward(dout)
    lay = layout if attn == "ring" else "contiguous"
    for name, want in (("out", ref), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        got = unshard_sequence([r[name] for r in results], lay, dim=2)  # type: ignore[arg-type]
        assert not got.isnan().any()
        torch.testing.assert_close(got, want.detach(), **TOL, msg=name)


STEPS = 2


def _doc_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, targets) ``(BATCH, SEQ)`` with EOS tokens (id 0) at several places."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        x = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        x[:, SEQ // 3] = EOS
        x[0, SEQ // 2 + 1] = EOS
        out.append((x, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)))
    return out


def _train(ctx: WorkerContext | None) -> dict[str, Any]:
    """Two AdamW steps of the built-in model with document masking, on a cp2 ring mesh
    (``ctx``) or one process (None): losses, the weights, the cp all-gather bytes."""
    from plait import init_mesh

    mesh = ctx.mesh(dp=1, cp=2) if ctx is not None else init_mesh()
    base = _builtin()
    base.documents = DocumentIds(EOS)
    pm = parallelize(base, mesh, ParallelConfig(cp_attention="ring"))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses = []
    for x, y in _doc_batches():
        losses.append(float(pm.step(x, y)))
        opt.step()
        opt.zero_grad()
    gathered = mesh.stats.get("cp", "all_gather").bytes if ctx is not None else 0
    weights = {n: p.detach().clone() for n, p in base.named_parameters()}
    return {"losses": losses, "weights": weights, "gathered": gathered}


def test_ring_model_with_documents_matches_one_process(pools: Pools) -> None:
    """cp2 ring: losses and weights after two steps equal one process (rtol 1e-9, the
    layouts differ in summation order); each forward all-gathers the uint8
    end-of-document flags of the whole sequence once: ``(cp-1)/cp · BATCH · SEQ`` bus
    bytes, as :mod:`plait.comm` counts an all-gather."""
    want = _train(None)
    for r in pools(2).run(_train):
        assert r["losses"] == pytest.approx(want["losses"], rel=1e-9)
        for name, w in want["weights"].items():
            torch.testing.assert_close(r["weights"][name], w, rtol=1e-9, atol=1e-11, msg=name)
        assert r["gathered"] == STEPS * (2 - 1) / 2 * BATCH * SEQ  # bus bytes: (cp-1)/cp
