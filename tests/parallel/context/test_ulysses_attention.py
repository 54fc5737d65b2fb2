"""All-to-all (Ulysses) attention at cp 2 and 4 against one process: outputs,
gradients and the all-to-all bytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plait.parallel.context.layout import shard_sequence, unshard_sequence
from plait.parallel.context.ulysses_attention import UlyssesAttention
from plait.testing import WorkerContext, WorkerPool

Pools = Callable[[int], WorkerPool]
B, H, S, D = 2, 4, 16, 8
TOL = dict(rtol=1e-10, atol=1e-12)


def _full(hk: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return r(B, H, S, D), r(B, hk, S, D), r(B, hk, S, D), r(B, H, S, D)


def _body(ctx: WorkerContext, hk: int, causal: bool) -> dict[str, Any]:
    mesh = ctx.mesh(dp=1, cp=ctx.world_size)
    cp, me = mesh.size("cp"), mesh.index("cp")
    q, k, v, dout = (shard_sequence(t, "contiguous", cp, me, dim=2) for t in _full(hk))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = UlyssesAttention(mesh.axis("cp"), causal=causal)(q, k, v)
    fwd = mesh.stats.get("cp", "all_to_all")
    out.backward(dout)
    both = mesh.stats.get("cp", "all_to_all")
    return {
        "out": out.detach(),
        "dq": q.grad,
        "dk": k.grad,
        "dv": v.grad,
        "fwd": (fwd.calls, fwd.bytes),
        "both": (both.calls, both.bytes),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("hk", "causal"), [(4, True), (2, True), (1, False)])
def test_ulysses_matches_one_process(pools: Pools, world: int, hk: int, causal: bool) -> None:
    """Equal to SDPA on the whole sequence (float64, 1e-10); four all-to-alls forward
    and four backward, each moving (cp-1)/cp of its tensor (KV heads fewer than cp or
    not divisible by it are repeated to the query heads first)."""
    results = pools(world).run(_body, hk, causal)
    q, k, v, dout = _full(hk)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hk != H)
    ref.backward(dout)
    for name, want in (("out", ref), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        got = unshard_sequence([r[name] for r in results], "contiguous", dim=2)
        torch.testing.assert_close(got, want.detach(), **TOL, msg=name)
    kv_heads = hk if hk % world == 0 else H
    shard = B * (S // world) * D * 8  # bytes of one head's sequence shard
    fwd = (world - 1) / world * shard * (2 * H + 2 * kv_heads)
    for r in results:
        assert r["fwd"] == (4, pytest.approx(fwd))
        assert r["both"] == (8, pytest.approx(2 * fwd))


def _refused(ctx: WorkerContext) -> str:
    mesh = ctx.mesh(dp=1, cp=ctx.world_size)
    q = torch.zeros(1, 3, 4, 2, dtype=torch.float64)
    try:
        UlyssesAttention(mesh.axis("cp"))(q, q, q)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_heads_not_divisible_refused(pools: Pools) -> None:
    assert all("3 heads are not divisible by cp=2" in r for r in pools(2).run(_refused))
