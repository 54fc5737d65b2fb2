"""Differentiable collectives (plait.comm.regions) on real gloo groups.

Each rank feeds a rank-dependent input and a rank-dependent upstream gradient (integer
valued, so sums are exact); the expected forward values and input gradients are built
here from every rank's tensors, without plait. Counters are checked against the bus-byte
convention: an all-gather plus a reduce-scatter of a tensor move the bytes of one
all-reduce of it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from plait.comm import regions as R
from plait.errors import ConfigError
from plait.testing import WorkerContext, WorkerPool

M = "tests.comm.test_regions"
Pools = Callable[[int], WorkerPool]
B, S, H = 2, 8, 6  # full activation (batch, seq, hidden); seq and hidden split by 2 and 4


def _val(rank: int, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    n = torch.tensor(shape).prod().item()
    pos = torch.arange(int(n), dtype=torch.float64)
    return (((rank * 5 + pos * 3 + salt) % 13) - 6).reshape(shape)


def _run(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, up: torch.Tensor) -> dict:
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(up)
    assert x.grad is not None
    return {"y": y.detach(), "dx": x.grad}


def _body(ctx: WorkerContext, op: str) -> dict[str, object]:
    mesh = ctx.mesh(tp=ctx.world_size)
    g = mesh.axis("tp")
    r, n = g.index, g.size
    full = (B, S, H)
    seq_shard = (B, S // n, H)
    if op == "copy":
        out = _run(lambda x: R.copy_to_region(x, g), _val(0, full, 1), _val(r, full, 2))
    elif op == "reduce":
        out = _run(lambda x: R.reduce_from_region(x, g), _val(r, full, 1), _val(0, full, 2))
    elif op == "gather_last":
        up = _val(0, (B, S, 3 * n), 2)
        out = _run(lambda x: R.gather_from_region(x, g), _val(r, (B, S, 3), 1), up)
    elif op == "scatter_last":
        x = _val(0, (B, S, 4 * n), 1)
        out = _run(lambda x: R.scatter_to_region(x, g), x, _val(r, (B, S, 4), 2))
    elif op == "gather_seq":
        out = _run(lambda x: R.gather_from_sequence(x, g), _val(r, seq_shard, 1), _val(r, full, 2))
    elif op == "reduce_scatter_seq":
        out = _run(
            lambda x: R.reduce_scatter_to_sequence(x, g), _val(r, full, 1), _val(r, seq_shard, 2)
        )
    elif op == "scatter_seq":
        out = _run(lambda x: R.scatter_to_sequence(x, g), _val(0, full, 1), _val(r, seq_shard, 2))
    else:
        raise ValueError(op)
    out["stats"] = mesh.stats.snapshot()
    return out


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.cat(parts, dim=dim)


def _expected(op: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(forward output, input gradient) per rank, from every rank's tensors."""
    full, shard = (B, S, H), (B, S // n, H)
    out = []
    for r in range(n):
        if op == "copy":
            y, dx = _val(0, full, 1), sum(_val(k, full, 2) for k in range(n))
        elif op == "reduce":
            y, dx = sum(_val(k, full, 1) for k in range(n)), _val(0, full, 2)
        elif op == "gather_last":
            y = _cat([_val(k, (B, S, 3), 1) for k in range(n)], -1)
            dx = _val(0, (B, S, 3 * n), 2)[..., 3 * r : 3 * r + 3]
        elif op == "scatter_last":
            y = _val(0, (B, S, 4 * n), 1)[..., 4 * r : 4 * r + 4]
            dx = _cat([_val(k, (B, S, 4), 2) for k in range(n)], -1)
        elif op == "gather_seq":
            y = _cat([_val(k, shard, 1) for k in range(n)], 1)
            dx = sum(_val(k, full, 2) for k in range(n))[:, r * S // n : (r + 1) * S // n]
        elif op == "reduce_scatter_seq":
            y = sum(_val(k, full, 1) for k in range(n))[:, r * S // n : (r + 1) * S // n]
            dx = _cat([_val(k, shard, 2) for k in range(n)], 1)
        else:  # scatter_seq
            y = _val(0, full, 1)[:, r * S // n : (r + 1) * S // n]
            dx = _cat([_val(k, shard, 2) for k in range(n)], 1)
        out.append((y, dx))
    return out


# op -> {collective: number of calls in forward + backward}
CALLS = {
    "copy": {"all_reduce": 1},
    "reduce": {"all_reduce": 1},
    "gather_last": {"all_gather": 1},
    "scatter_last": {"all_gather": 1},
    "gather_seq": {"all_gather": 1, "reduce_scatter": 1},
    "reduce_scatter_seq": {"all_gather": 1, "reduce_scatter": 1},
    "scatter_seq": {"all_gather": 1},
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("op", list(CALLS))
def test_region_values_gradients_and_counts(pools: Pools, world: int, op: str) -> None:
    results = pools(world).run(f"{M}:_body", op)
    for res, (y, dx) in zip(results, _expected(op, world), strict=True):
        torch.testing.assert_close(res["y"], y, rtol=0, atol=0)
        torch.testing.assert_close(res["dx"], dx, rtol=0, atol=0)
        calls = {k.split("/")[1]: v["calls"] for k, v in res["stats"].items()}
        assert calls == CALLS[op]
    if op in ("gather_seq", "reduce_scatter_seq"):  # the SP pair moves one all-reduce's bytes
        st = results[0]["stats"]
        full_bytes = B * S * H * 8
        pair = st["tp/all_gather"]["bytes"] + st["tp/reduce_scatter"]["bytes"]
        assert pair == pytest.approx(2 * (world - 1) / world * full_bytes, rel=1e-12)


def _body_grad_hook(ctx: WorkerContext) -> list[float]:
    mesh = ctx.mesh(tp=ctx.world_size)
    g = mesh.axis("tp")
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    R.sum_grad_over(w, g)
    for _ in range(2):  # accumulation: each pass is summed before it is accumulated
        (w * (g.index + 1)).sum().backward()
    assert w.grad is not None
    return w.grad.tolist()


def test_sum_grad_over_sums_each_pass_before_accumulation(pools: Pools) -> None:
    n = 4
    expected = [2.0 * sum(range(1, n + 1))] * 3
    assert pools(n).run(f"{M}:_body_grad_hook") == [expected] * n


def _body_bad_sequence(ctx: WorkerContext) -> tuple[str, int]:
    mesh = ctx.mesh(tp=ctx.world_size)
    x = torch.zeros(2, 6, 4, requires_grad=True)  # seq 6 does not split over 4 ranks
    try:
        R.reduce_scatter_to_sequence(x, mesh.axis("tp"))
    except ConfigError as e:
        return str(e), sum(int(v["calls"]) for v in mesh.stats.snapshot().values())
    return "no error", -1


def test_indivisible_sequence_refused_before_communication(pools: Pools) -> None:
    for msg, calls in pools(4).run(f"{M}:_body_bad_sequence"):
        assert "length 6" in msg and "multiple of 4" in msg
        assert calls == 0


@pytest.mark.parametrize(("length", "hint"), [(6, "(e.g. 4 or 8)"), (2, "(e.g. 4)")])
def test_indivisible_message_suggests_distinct_lengths(length: int, hint: str) -> None:
    """The refusal names the nearest multiples; a length below the group size has only
    one (no "e.g. 4 or 4"). Raised before any communication: no process group needed."""
    from plait.comm.group import AxisGroup
    from plait.comm.stats import CommStats

    g = AxisGroup("tp", (0, 1, 2, 3), 0, 1.0, CommStats())
    with pytest.raises(ConfigError, match="multiple of 4") as e:
        R.split_along(torch.zeros(length, 3), g, 0, "the sequence")
    assert str(e.value).endswith(hint), str(e.value)
