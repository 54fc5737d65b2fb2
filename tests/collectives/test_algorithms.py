"""All-reduce (and gather/scatter/all-to-all) algorithms on point-to-point messages.

Values: every algorithm is compared with the library collective on random fp32/fp64
tensors (odd sizes, sizes not divisible by N, several shapes, sum and avg) at world
sizes 2, 3, 4, 6 and 8. Summation order differs from gloo's, so the comparison has a
tolerance (fp32 rtol 1e-5 / atol 1e-5, fp64 rtol 1e-12 / atol 1e-12); every rank's
result must be bit-identical to every other rank's.

Traffic: the bytes and steps measured from the comm counters must equal the closed
forms of :mod:`plait.collectives.costs` exactly, and, for sizes divisible by N at N = 2, 4, 8,
the textbook numbers written out here independently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from plait import comm
from plait.collectives import algorithms as algo
from plait.collectives import costs
from plait.errors import ConfigError
from plait.testing import WorkerContext, WorkerPool

M = "tests.collectives.test_algorithms"
Pools = Callable[[int], WorkerPool]
NAMES = sorted(algo.ALL_REDUCE)

# (shape, dtype, op): odd sizes, primes, sizes below and not divisible by N, a scalar
CASES: list[tuple[tuple[int, ...], str, str]] = [
    ((1,), "float32", "sum"),
    ((7,), "float64", "avg"),
    ((13, 5), "float32", "sum"),
    ((3, 1, 11), "float64", "sum"),
    ((1031,), "float32", "avg"),
    ((), "float64", "sum"),
]
TOL = {"float32": (1e-5, 1e-5), "float64": (1e-12, 1e-12)}


def _rand(rank: int, shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=g, dtype=getattr(torch, dtype))


def _body_values(ctx: WorkerContext, names: list[str]) -> dict[str, Any]:
    g = ctx.mesh(dp=ctx.world_size).axis("dp")
    out: dict[str, Any] = {}
    for c, (shape, dtype, op) in enumerate(CASES):
        x = _rand(ctx.rank, shape, dtype, c)
        ref = x.clone()
        comm.all_reduce(ref, g, op=op)  # type: ignore[arg-type]
        for name in names:
            y = x.clone()
            algo.all_reduce(y, g, name, op)  # type: ignore[arg-type]
            out[f"{name}/{c}"] = (y, ref)
    # a non-contiguous input (a transposed view) is reduced in place too
    z = _rand(ctx.rank, (6, 5), "float64", 99).t()
    zref = z.clone()
    comm.all_reduce(zref, g)
    algo.all_reduce_ring(z, g, pipeline=3)
    out["ring/transposed"] = (z, zref)
    # the other collectives, against their library counterparts
    n = ctx.world_size
    for c, (rows, dtype) in enumerate([(2 * n, "float32"), (3 * n, "float64")]):
        x = _rand(ctx.rank, (rows, 3), dtype, 50 + c)
        ag, _ = algo.ring_all_gather(x, g, pipeline=2)
        out[f"all_gather/{c}"] = (ag, comm.all_gather(x, g))
        rs, _ = algo.ring_reduce_scatter(x, g, "avg", pipeline=2)
        out[f"reduce_scatter/{c}"] = (rs, comm.reduce_scatter(x, g, op="avg"))
        rs, _ = algo.ring_reduce_scatter(x, g, "sum")
        out[f"reduce_scatter_sum/{c}"] = (rs, comm.reduce_scatter(x, g, op="sum"))
        a2a, _ = algo.direct_all_to_all(x, g)
        out[f"all_to_all/{c}"] = (a2a, comm.all_to_all(x, g))
        out[f"input_untouched/{c}"] = (x, _rand(ctx.rank, (rows, 3), dtype, 50 + c))
    return out


def _check_values(results: list[dict[str, Any]]) -> None:
    for key in results[0]:
        for rank, res in enumerate(results):
            got, ref = res[key]
            assert got.shape == ref.shape and got.dtype == ref.dtype, key
            rtol, atol = TOL[str(got.dtype).replace("torch.", "")]
            if key.startswith("input_untouched"):
                assert torch.equal(got, ref), key
            else:
                torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, msg=f"{key} r{rank}")
        if not key.startswith(("all_to_all", "reduce_scatter", "input")):
            for res in results[1:]:  # replicas are bit-identical
                assert torch.equal(res[key][0], results[0][key][0]), key


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_every_algorithm_equals_library(pools: Pools, world: int) -> None:
    _check_values(pools(world).run(f"{M}:_body_values", NAMES))


# ---------------------------------------------------------------- traffic


def _body_traffic(ctx: WorkerContext, sizes: list[int]) -> list[tuple[Any, Any]]:
    g = ctx.mesh(dp=ctx.world_size).axis("dp")
    out = []
    for numel in sizes:
        for dtype in (torch.float32, torch.float64):
            x = torch.ones(numel, dtype=dtype)
            for name in NAMES:
                rep = algo.all_reduce(x.clone(), g, name, measure=True)
                out.append((rep.formula, rep.measured))
            n = ctx.world_size
            y = torch.ones(n * numel, dtype=dtype)
            for rep in (
                algo.ring_all_gather(x, g, pipeline=2, measure=True)[1],
                algo.ring_reduce_scatter(y, g, pipeline=3, measure=True)[1],
                algo.direct_all_to_all(y, g, measure=True)[1],
            ):
                out.append((rep.formula, rep.measured))
    return out


def _textbook(name: str, n: int, s: int) -> dict[str, Any]:
    """Textbook steps / per-rank bytes for n a power of two and sizes divisible by n."""
    lg = n.bit_length() - 1
    ring = 2 * (n - 1) * s // n
    return {
        "naive": {"steps": 2 * (n - 1), "peak": (n - 1) * s, "total": 2 * (n - 1) * s},
        "central": {"steps": 2, "peak": (n - 1) * s, "total": 2 * (n - 1) * s},
        "ring": {"steps": 2 * (n - 1), "each": ring, "total": 2 * (n - 1) * s},
        "recursive_doubling": {"steps": lg, "each": lg * s, "total": n * lg * s},
        "rabenseifner": {"steps": 2 * lg, "each": ring, "total": 2 * (n - 1) * s},
        "tree": {"steps": 2 * lg, "peak": {2: 1, 4: 2, 8: 3}[n] * s, "total": 2 * (n - 1) * s},
        "direct": {"steps": 1, "each": (n - 1) * s, "total": n * (n - 1) * s},
        "ring_all_gather": {"steps": n - 1, "each": (n - 1) * s},
        "ring_reduce_scatter": {"steps": n - 1, "each": (n - 1) * s // n},
        "direct_all_to_all": {"steps": 1, "each": (n - 1) * s // n},
    }[name]


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_measured_traffic_equals_formula(pools: Pools, world: int) -> None:
    divisible = [8 * 3 * 5]  # divisible by 2, 3, 4, 6 and 8
    odd = [1, 5, 1033]  # fewer elements than ranks, and a prime
    results = pools(world).run(f"{M}:_body_traffic", divisible + odd)
    first = results[0]
    for res in results[1:]:  # every rank gathered the same table
        assert res == first
    pow2 = world & (world - 1) == 0
    for i, (formula, measured) in enumerate(first):
        assert measured is not None
        assert dataclasses.asdict(measured) == dataclasses.asdict(formula), formula.algorithm
        assert measured.total_bytes == sum(measured.received)
        per_size = len(first) // (len(divisible) + len(odd))
        if i < per_size and pow2:  # the divisible size: the textbook numbers
            book = _textbook(formula.algorithm, world, formula.nbytes)
            assert measured.steps == book["steps"], formula.algorithm
            if "each" in book:
                assert set(measured.sent) == {book["each"]}, formula.algorithm
            if "peak" in book:
                assert measured.peak_sent == book["peak"], formula.algorithm
            if "total" in book:
                assert measured.total_bytes == book["total"], formula.algorithm


def test_asymptotics_table() -> None:
    """The asymptotics (docs/collectives.md) from the closed forms, N = 2, 4, 8, S = 1 MiB fp32."""
    n_el, e = 2**18, 4
    s = n_el * e
    rows = {
        name: [costs.formula(name, n, n_el, e) for n in (2, 4, 8)]
        for name in ("naive", "central", "ring", "recursive_doubling", "direct", "tree")
    }
    assert [c.peak_sent for c in rows["naive"]] == [s, 3 * s, 7 * s]  # O(N) per node
    assert [c.peak_sent for c in rows["central"]] == [s, 3 * s, 7 * s]
    assert [c.steps for c in rows["central"]] == [2, 2, 2]  # O(1) steps
    assert [c.steps for c in rows["naive"]] == [2, 6, 14]  # O(N) steps
    assert all(c.peak_sent < 2 * s for c in rows["ring"])  # O(1) per node
    assert [c.steps for c in rows["ring"]] == [2, 6, 14]
    assert [c.total_bytes for c in rows["direct"]] == [2 * s, 12 * s, 56 * s]  # O(N^2)
    assert [c.steps for c in rows["recursive_doubling"]] == [1, 2, 3]  # log2 N
    assert [c.steps for c in rows["tree"]] == [2, 4, 6]
    assert costs.recursive_doubling(6, 6, 4).steps == 4  # 2 + the fallback's 2
    # the printed table (the one `plait bench comm` fills from the counters)
    table = costs.traffic_table([c for name in rows for c in rows[name]], {"ring": True})
    for line in (
        "| naive | 8 | 14 | 1 .. 7 | 7 | 14 | 14 | O(N) / O(N) / O(N) | NO |",
        "| central | 8 | 2 | 1 .. 7 | 7 | 14 | 14 | O(1) / O(N) / O(N) | NO |",
        "| ring | 8 | 14 | 1.75 | 1.75 | 14 | 1.75 | O(N) / O(1) / O(N) | yes |",
        "| recursive_doubling | 4 | 2 | 2 | 2 | 8 | 2 |",
        "| direct | 8 | 1 | 7 | 7 | 56 | 7 | O(1) / O(N) / O(N^2) | NO |",
        "| tree | 8 | 6 | 1 .. 3 | 3 | 14 | 10 |",
    ):
        assert line in table, line


# ---------------------------------------------------------------- bad input


def _error(fn: Callable[[], object]) -> str:
    try:
        fn()
    except (ValueError, ConfigError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _body_bad(ctx: WorkerContext) -> dict[str, str]:
    g = ctx.mesh(dp=ctx.world_size).axis("dp")
    out = {}
    for name in ("recursive_doubling", "rabenseifner"):
        out[name] = _error(lambda n=name: algo.all_reduce(torch.ones(4), g, n, fallback=False))
    shape = (4,) if ctx.rank == 0 else (5,)
    for name in NAMES:
        out[f"shape/{name}"] = _error(lambda n=name: algo.all_reduce(torch.ones(shape), g, n))
    dtype = torch.float32 if ctx.rank else torch.float64
    out["dtype"] = _error(lambda: algo.all_reduce(torch.ones(3, dtype=dtype), g, "tree"))
    out["gather_shape"] = _error(lambda: algo.ring_all_gather(torch.ones(shape), g))
    out["rs_dim0"] = _error(lambda: algo.ring_reduce_scatter(torch.ones(ctx.world_size + 1), g))
    out["avg_int"] = _error(lambda: algo.all_reduce(torch.ones(3, dtype=torch.int64), g, op="avg"))
    out["unknown"] = _error(lambda: algo.all_reduce(torch.ones(3), g, "butterfly"))
    out["op"] = _error(lambda: algo.all_reduce(torch.ones(3), g, "ring", op="max"))  # type: ignore[arg-type]
    # the group still works afterwards: nothing was left half-sent
    y = torch.full((5,), float(ctx.rank))
    algo.all_reduce_ring(y, g)
    out["after"] = str(y.tolist())
    return out


def test_bad_input_is_refused_on_every_rank(pools: Pools) -> None:
    results = pools(6).run(f"{M}:_body_bad")
    for res in results:
        for name in ("recursive_doubling", "rabenseifner"):
            assert res[name].startswith("ConfigError") and "power-of-two" in res[name]
            assert "4 or 8 ranks" in res[name] and "fallback=True" in res[name]
        for name in NAMES:
            msg = res[f"shape/{name}"]
            assert "differs in shape" in msg and "rank 0: (4) float32" in msg, msg
            assert "rank 1: (5) float32" in msg, msg
        assert "rank 0: (3) float64" in res["dtype"] and "rank 1: (3) float32" in res["dtype"]
        assert "differs in shape" in res["gather_shape"]
        assert "not divisible by 6" in res["rs_dim0"]
        assert "floating-point" in res["avg_int"]
        assert "butterfly" in res["unknown"] and "ring" in res["unknown"]
        assert "'max' is not supported" in res["op"]
        assert res["after"] == str([15.0] * 5)


def test_formula_refuses_bad_sizes() -> None:
    with pytest.raises(ValueError, match="unknown algorithm"):
        costs.formula("butterfly", 4, 10, 4)
    with pytest.raises(ValueError, match="bad sizes"):
        costs.formula("ring", 0, 10, 4)
