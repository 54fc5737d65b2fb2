"""Gradient compressors on their own: exactness where the method is exact, the
error-feedback identity, bytes on the wire, warm-up, and state round trips.

Tolerances: float64 throughout; "exact" methods (top-k with rho = 1, PowerSGD at full
rank) match the plain all-reduce to 1e-12 relative (they add in another order, and
PowerSGD goes through a QR); the bf16 cast matches the cast-reduce-cast reference bit
for bit (the same operations); the error-feedback identity holds to 1e-12.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from plait import comm, init_mesh
from plait.parallel.compression import (
    CastCompressor,
    Compressor,
    PowerSGDCompressor,
    TopKCompressor,
    make_compressor,
)
from plait.parallel.compression.topk import topk_count
from plait.testing import WorkerContext, WorkerPool

M = "tests.parallel.compression.test_compressors"
SHAPES = [torch.Size([24, 10]), torch.Size([10]), torch.Size([6, 4, 5]), torch.Size([7])]
NUMEL = sum(math.prod(s) for s in SHAPES)


def _grad(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(NUMEL, generator=g, dtype=torch.float64)  # (numel,) one bucket


def _make(name: str) -> Compressor:
    if name == "topk1":
        return TopKCompressor(1.0)
    if name == "topk":
        return TopKCompressor(0.1)
    if name == "topk_warm":  # the sparsity warm-up: 0.25 -> 0.1 over 3 steps
        return TopKCompressor(0.1, warmup=3)
    if name == "powersgd_full":
        return PowerSGDCompressor(rank=64, min_compression_rate=0.0)
    if name == "powersgd":
        return PowerSGDCompressor(rank=1, min_compression_rate=0.0)
    if name == "bf16":
        return CastCompressor("bf16")
    raise KeyError(name)


def _body_exact(ctx: WorkerContext, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mesh = ctx.mesh(dp=ctx.world_size)
    group = mesh.axis("dp")
    c = _make(name)
    out = []
    for step in range(3):  # a warm-started Q must stay exact too
        g = _grad(group.index, step) / group.size
        mine = g.clone()
        c.reduce(0, mine, SHAPES, group)()
        ref = g.clone()
        if name == "bf16":  # the cast-reduce-cast reference
            half = ref.to(torch.bfloat16)
            comm.all_reduce(half, group, op="sum")
            ref = half.to(torch.float64)
        else:
            comm.all_reduce(ref, group, op="sum")
        out.append((mine, ref))
    residual = c.errors[0].clone() if c.errors else torch.zeros(NUMEL, dtype=torch.float64)
    return torch.stack([a for a, _ in out]), torch.stack([b for _, b in out]), residual


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["topk1", "powersgd_full", "bf16"])
def test_exact_methods_equal_the_plain_all_reduce(
    pools: Callable[[int], WorkerPool], world: int, name: str
) -> None:
    results = pools(world).run(f"{M}:_body_exact", name)
    for mine, ref, _ in results:
        if name == "bf16":
            assert torch.equal(mine, ref)  # bit for bit
        else:
            torch.testing.assert_close(mine, ref, rtol=1e-12, atol=1e-12)
    # nothing is left unsent overall: a rank's own residual (M_r minus its projection on
    # the common basis P) need not vanish at full rank, but the ranks' residuals cancel
    total = sum(r[2] for r in results)
    assert float(total.abs().max()) < 1e-12
    for mine, _, _ in results[1:]:
        assert torch.equal(mine, results[0][0])  # every rank holds the same result


def _body_feedback(ctx: WorkerContext, name: str, steps: int) -> dict[str, torch.Tensor]:
    mesh = ctx.mesh(dp=ctx.world_size)
    group = mesh.axis("dp")
    c = _make(name)
    c.keep_sent = True
    true_sum = torch.zeros(NUMEL, dtype=torch.float64)
    sent_sum = torch.zeros(NUMEL, dtype=torch.float64)
    applied_sum = torch.zeros(NUMEL, dtype=torch.float64)
    for step in range(steps):
        g = _grad(group.index, step) / group.size
        true_sum += g
        flat = g.clone()
        c.reduce(0, flat, SHAPES, group)()
        sent_sum += c.sent[0]
        applied_sum += flat
    return {
        "true": true_sum,
        "sent": sent_sum,
        "applied": applied_sum,
        "error": c.errors[0].clone(),
    }


@pytest.mark.parametrize("name", ["topk", "topk_warm", "powersgd"])
def test_error_feedback_loses_nothing(pools: Callable[[int], WorkerPool], name: str) -> None:
    """Per rank: sum of what it sent + its final residual == sum of its true gradients;
    over the group: the applied (reduced) gradients are the sum of what the ranks sent."""
    results = pools(2).run(f"{M}:_body_feedback", name, 5)
    for r in results:
        torch.testing.assert_close(r["sent"] + r["error"], r["true"], rtol=1e-12, atol=1e-12)
        assert float(r["error"].abs().max()) > 1e-3  # the method really is lossy here
    total_sent = sum(r["sent"] for r in results)
    torch.testing.assert_close(results[0]["applied"], total_sent, rtol=1e-12, atol=1e-12)
    total_true = sum(r["true"] for r in results)
    total_err = sum(r["error"] for r in results)
    torch.testing.assert_close(
        results[0]["applied"] + total_err, total_true, rtol=1e-12, atol=1e-12
    )


def _body_bytes(ctx: WorkerContext, name: str) -> dict[str, float]:
    mesh = ctx.mesh(dp=ctx.world_size)
    group = mesh.axis("dp")
    c = make_compressor(name, ratio=0.05, rank=2)
    assert c is not None
    mesh.stats.reset()
    flat = _grad(group.index, 0)
    c.reduce(0, flat, SHAPES, group)()
    return {op: mesh.stats.get("dp", op).bytes for op in ("all_reduce", "all_gather")} | {
        "calls": float(mesh.stats.get("dp", "all_reduce").calls)
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["bf16", "fp16", "topk", "powersgd"])
def test_bytes_on_the_wire_equal_the_formula(
    pools: Callable[[int], WorkerPool], world: int, name: str
) -> None:
    n = world
    ring = 2 * (n - 1) / n  # all-reduce bus factor; all-gather: (n - 1) / n of the output
    if name in ("bf16", "fp16"):
        want = {"all_reduce": ring * 2 * NUMEL, "all_gather": 0.0}
    elif name == "topk":
        # per tensor: ceil(0.05 * 240) = 12 of [24, 10], 6 of [6, 4, 5]; vectors whole
        k = topk_count(240, 0.05) + 10 + topk_count(120, 0.05) + 7
        assert k == 12 + 10 + 6 + 7
        want = {"all_reduce": 0.0, "all_gather": (n - 1) / n * n * k * (4 + 8)}
    else:
        # rank 2, default min_compression_rate 2: [24, 10] -> (24 + 10) * 2 = 68 <= 120;
        # [6, 4, 5] viewed (6, 20): (6 + 20) * 2 = 52 <= 60; the vectors go plain.
        compressed, plain = PowerSGDCompressor(2).wire_elements(SHAPES)
        assert (compressed, plain) == (68 + 52, 10 + 7)
        want = {"all_reduce": ring * 8 * (compressed + plain), "all_gather": 0.0}
    for r in pools(world).run(f"{M}:_body_bytes", name):
        assert r["all_reduce"] == pytest.approx(want["all_reduce"], rel=1e-12)
        assert r["all_gather"] == pytest.approx(want["all_gather"], rel=1e-12)
        if name == "powersgd":
            assert r["calls"] == 3  # the plain tensors, P, Q


def test_one_rank_is_the_degenerate_case() -> None:
    group = init_mesh().axis("dp")
    for name in ("bf16", "topk", "powersgd"):
        c = make_compressor(name, ratio=1.0, rank=64)
        assert c is not None
        g = _grad(0, 0)
        flat = g.clone()
        c.reduce(0, flat, SHAPES, group)()
        if name == "bf16":
            assert torch.equal(flat, g.to(torch.bfloat16).double())
        elif name == "topk":
            assert torch.equal(flat, g)


def test_state_round_trip_and_warm_up() -> None:
    group = init_mesh().axis("dp")
    a = PowerSGDCompressor(rank=1, start=2, min_compression_rate=0.0)
    assert not a.active
    a.end_step()
    a.end_step()
    assert a.active
    a.reduce(3, _grad(0, 0), SHAPES, group)()
    a.end_step()
    b = PowerSGDCompressor(rank=1, start=2, min_compression_rate=0.0)
    b.load_state_dict({k: v.clone() for k, v in a.state_dict().items()})
    assert b.steps == 3 and b.active
    assert b.errors.keys() == a.errors.keys() and b.qs.keys() == a.qs.keys()
    x, y = _grad(0, 1), _grad(0, 1)
    a.reduce(3, x, SHAPES, group)()
    b.reduce(3, y, SHAPES, group)()
    assert torch.equal(x, y)  # the same error and warm-start Q give the same result


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="ratio"):
        TopKCompressor(0.0)
    with pytest.raises(ValueError, match="ratio"):
        TopKCompressor(1.5)
    with pytest.raises(ValueError, match="rank"):
        PowerSGDCompressor(0)
    with pytest.raises(ValueError, match="unknown compression"):
        make_compressor("zip")
