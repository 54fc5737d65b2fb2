"""Ring attention at cp 2 and 4 against one process: outputs, gradients, traffic,
overlap (recorded events) and causal load balance (pairs computed per rank)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plait.parallel.context.layout import causal_pairs, shard_sequence, unshard_sequence
from plait.parallel.context.ring_attention import RingAttention
from plait.testing import WorkerContext, WorkerPool

Pools = Callable[[int], WorkerPool]
B, H, HK, S, D = 2, 4, 2, 16, 8
TOL = dict(rtol=1e-10, atol=1e-12)


def _full(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v ``(B, heads, S, D)`` and the output gradient, float64."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return r(B, H, S, D), r(B, HK, S, D), r(B, HK, S, D), r(B, H, S, D)


def _body(ctx: WorkerContext, causal: bool, layout: str, impl: str) -> dict[str, Any]:
    mesh = ctx.mesh(dp=1, cp=ctx.world_size)
    cp, me = mesh.size("cp"), mesh.index("cp")
    ring = RingAttention(
        mesh.axis("cp"), causal=causal, layout=layout, impl=impl, record_events=True
    )  # type: ignore[arg-type]
    q, k, v, dout = (shard_sequence(t, layout, cp, me, dim=2) for t in _full())  # type: ignore[arg-type]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ring(q, k, v)
    fwd_send = mesh.stats.get("cp", "send")
    fwd_events = list(ring.events)
    out.backward(dout)
    total_send = mesh.stats.get("cp", "send")
    return {
        "out": out.detach(),
        "dq": q.grad,
        "dk": k.grad,
        "dv": v.grad,
        "fwd_send": (fwd_send.calls, fwd_send.bytes),
        "all_send": (total_send.calls, total_send.bytes),
        "recv_bytes": mesh.stats.get("cp", "recv").bytes,
        "events": fwd_events,
        "pairs": ring.pairs,
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    ("causal", "layout", "impl"),
    [(True, "zigzag", "fused"), (True, "contiguous", "reference"), (False, "zigzag", "fused")],
)
def test_ring_matches_one_process(
    pools: Pools, world: int, causal: bool, layout: str, impl: str
) -> None:
    """Outputs and q/k/v gradients equal SDPA on the whole sequence (float64, 1e-10);
    bytes sent per rank are (cp-1) K/V blocks forward and (cp-1)·2 in backward."""
    results = pools(world).run(_body, causal, layout, impl)
    q, k, v, dout = _full()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    ref.backward(dout)
    for name, want in (("out", ref), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        got = unshard_sequence([r[name] for r in results], layout, dim=2)  # type: ignore[arg-type]
        torch.testing.assert_close(got, want.detach(), **TOL, msg=name)
    block = 2 * B * HK * (S // world) * D * 8  # one stacked K/V message, bytes
    for r in results:
        assert r["fwd_send"] == (world - 1, (world - 1) * block)
        assert r["all_send"] == (3 * (world - 1), 3 * (world - 1) * block)
        assert r["recv_bytes"] == 3 * (world - 1) * block


@pytest.mark.parametrize("world", [2, 4])
def test_overlap_and_balance(pools: Pools, world: int) -> None:
    """Block i+1's receive is posted before block i's compute ends (recorded events);
    with zigzag every rank computes the same pairs, contiguous follows the formula."""
    zig = pools(world).run(_body, True, "zigzag", "fused")
    flat = pools(world).run(_body, True, "contiguous", "fused")
    for r in zig:
        ev = {(what, step): t for what, step, t in r["events"]}
        for i in range(world - 1):
            assert ev[("post", i + 1)] < ev[("compute_end", i)]
            assert ev[("compute_start", i + 1)] > ev[("wait", i + 1)]
    pairs = [r["pairs"] for r in zig]
    assert len(set(pairs)) == 1
    assert pairs[0] == B * H * causal_pairs("zigzag", world, 0, S)
    c = S // (2 * world)
    assert pairs[0] == B * H * ((2 * world - 1) * c * c + c * (c + 1))
    uneven = [r["pairs"] for r in flat]
    assert uneven == [B * H * (2 * c * 2 * r * c + c * (2 * c + 1)) for r in range(world)]
    assert sum(uneven) == sum(pairs) == B * H * S * (S + 1) // 2
