"""Every operation of plait.comm on real gloo groups: exact values and exact counters.

Inputs depend on the global rank and the position (integer-valued, so sums, products
and averages over 2 or 4 ranks are exact); the expected results and the bus bytes are
computed here, independently of plait, from hard-coded group memberships. Each
collective runs on the whole world (axis "dp" of ``dp=N``) and, on 4 ranks, on both
2-wide axes of ``dp=2, tp=2`` to check that sub-groups and peer indices map to the
right global ranks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch

from plait import comm, init_mesh
from plait.errors import CommTimeoutError
from plait.testing import WorkerContext, WorkerPool

M = "tests.comm.test_ops"

# (world size, mesh degrees, axis, the groups of that axis as global ranks in axis order)
CASES = [
    pytest.param(2, {"dp": 2}, "dp", [[0, 1]], id="w2-dp2"),
    pytest.param(4, {"dp": 4}, "dp", [[0, 1, 2, 3]], id="w4-dp4"),
    pytest.param(4, {"dp": 2, "tp": 2}, "tp", [[0, 1], [2, 3]], id="w4-dp2tp2-tp"),
    pytest.param(4, {"dp": 2, "tp": 2}, "dp", [[0, 2], [1, 3]], id="w4-dp2tp2-dp"),
]

Pools = Callable[[int], WorkerPool]


# ---------------------------------------------------------------- shared helpers


def _input(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Integer values in [-5, 5] that differ between ranks and positions."""
    n = 1
    for s in shape:
        n *= s
    pos = torch.arange(n, dtype=torch.int64)
    return (((rank * 7 + pos * 3) % 11) - 5).to(dtype).reshape(shape)


def _bus(op: str, nbytes: int, n: int) -> float:
    """The nccl-tests bus-byte convention, written out independently of plait."""
    if n == 1 or op == "barrier":
        return 0.0
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "gather": (n - 1) / n,
        "scatter": (n - 1) / n,
        "broadcast": 1.0,
        "reduce": 1.0,
        "send": 1.0,
        "recv": 1.0,
    }[op]
    return factor * nbytes


def _stats(mesh: Any, axis: str, ops: list[str]) -> dict[str, Any]:
    """Counters of ``ops`` on ``axis`` as plain data, plus the totals."""
    return {
        "ops": {op: dataclasses.asdict(mesh.stats.get(axis, op)) for op in ops},
        "total": mesh.stats.total_bytes(axis),
        "total_all": mesh.stats.total_bytes(),
    }


def _group(groups: list[list[int]], rank: int) -> list[int]:
    (g,) = [g for g in groups if rank in g]
    return g


def _check_stats(
    st: dict[str, Any], expected: dict[str, tuple[int, float]], blocking: set[str]
) -> None:
    """``expected`` maps op -> (calls, bus bytes); ops in ``blocking`` must show time."""
    for op, (calls, nbytes) in expected.items():
        got = st["ops"][op]
        assert got["calls"] == calls, op
        assert got["bytes"] == pytest.approx(nbytes, rel=1e-12, abs=0), op
        assert got["seconds"] >= 0.0, op
        if op in blocking:
            assert got["seconds"] > 0.0, op
    total = sum(b for _, b in expected.values())
    assert st["total"] == pytest.approx(total, rel=1e-12, abs=0)
    assert st["total_all"] == pytest.approx(total, rel=1e-12, abs=0)  # nothing on other axes


def test_bus_byte_convention() -> None:
    for n in (1, 2, 3, 4, 8):
        for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "gather"):
            assert comm.bus_bytes(op, 96, n) == pytest.approx(_bus(op, 96, n)), (op, n)
        for op in ("scatter", "broadcast", "reduce", "send", "recv", "barrier"):
            assert comm.bus_bytes(op, 96, n) == pytest.approx(_bus(op, 96, n)), (op, n)
    with pytest.raises(ValueError, match="no bus-byte convention"):
        comm.bus_bytes("all_gatherv", 96, 4)


# ---------------------------------------------------------------- all_reduce

AR_SHAPE = (3, 4)
AR_OPS = ["sum", "avg", "max", "min", "product"]


def _body_all_reduce(ctx: WorkerContext, degrees: dict[str, int], axis: str) -> dict[str, Any]:
    mesh = ctx.mesh(**degrees)
    g = mesh.axis(axis)
    out: dict[str, Any] = {"ranks": list(g.ranks), "index": g.index, "size": g.size}
    for op in AR_OPS:
        t = _input(ctx.rank, AR_SHAPE, torch.float64)
        assert comm.all_reduce(t, g, op=op) is None
        out[op] = t.tolist()
    grew = []
    for op in ("sum", "avg"):
        t = _input(ctx.rank, AR_SHAPE, torch.float64)
        calls = mesh.stats.get(axis, "all_reduce").calls
        h = comm.all_reduce(t, g, op=op, async_op=True)
        assert isinstance(h, comm.Handle)
        # counted when started; the blocked time is added by wait()
        assert mesh.stats.get(axis, "all_reduce").calls == calls + 1
        seconds = mesh.stats.get(axis, "all_reduce").seconds
        h.wait()
        grew.append(mesh.stats.get(axis, "all_reduce").seconds > seconds)
        h.wait()  # a second wait is harmless and does not divide again
        assert h.is_completed()
        out[f"async_{op}"] = t.tolist()
    out["async_wait_counted"] = grew
    out["stats"] = _stats(mesh, axis, ["all_reduce"])
    return out


@pytest.mark.parametrize(("world", "degrees", "axis", "groups"), CASES)
def test_all_reduce(
    pools: Pools, world: int, degrees: dict[str, int], axis: str, groups: list[list[int]]
) -> None:
    results = pools(world).run(f"{M}:_body_all_reduce", degrees, axis)
    n = len(groups[0])
    nbytes = 3 * 4 * 8
    for rank, res in enumerate(results):
        members = _group(groups, rank)
        assert res["ranks"] == members
        assert res["index"] == members.index(rank)
        assert res["size"] == n
        xs = torch.stack([_input(r, AR_SHAPE, torch.float64) for r in members])
        expected = {
            "sum": xs.sum(0),
            "avg": xs.sum(0) / n,
            "max": xs.max(0).values,
            "min": xs.min(0).values,
            "product": xs.prod(0),
        }
        for op, want in expected.items():
            assert res[op] == want.tolist(), op
        assert res["async_sum"] == expected["sum"].tolist()
        assert res["async_avg"] == expected["avg"].tolist()
        assert res["async_wait_counted"] == [True, True]
        _check_stats(
            res["stats"], {"all_reduce": (7, 7 * 2 * (n - 1) / n * nbytes)}, {"all_reduce"}
        )


# ---------------------------------------------------------------- gather-scatter family


def _body_gather_scatter_family(
    ctx: WorkerContext, degrees: dict[str, int], axis: str
) -> dict[str, Any]:
    mesh = ctx.mesh(**degrees)
    g = mesh.axis(axis)
    n = g.size
    out: dict[str, Any] = {}

    x = _input(ctx.rank, (2, 3))
    out["all_gather"] = comm.all_gather(x, g).tolist()
    res, h = comm.all_gather(x, g, async_op=True)
    h.wait()
    out["all_gather_async"] = res.tolist()

    y = _input(ctx.rank, (2 * n, 3))
    out["rs_sum"] = comm.reduce_scatter(y, g).tolist()
    out["rs_avg"] = comm.reduce_scatter(y, g, op="avg").tolist()
    res, h = comm.reduce_scatter(y, g, op="avg", async_op=True)
    h.wait()
    out["rs_avg_async"] = res.tolist()
    assert y.tolist() == _input(ctx.rank, (2 * n, 3)).tolist()  # the input is left alone

    z = _input(ctx.rank, (2 * n, 2), torch.int64)
    out["a2a"] = comm.all_to_all(z, g).tolist()
    res, h = comm.all_to_all(z, g, async_op=True)
    h.wait()
    out["a2a_async"] = res.tolist()

    out["stats"] = _stats(mesh, axis, ["all_gather", "reduce_scatter", "all_to_all"])
    return out


@pytest.mark.parametrize(("world", "degrees", "axis", "groups"), CASES)
def test_all_gather_reduce_scatter_all_to_all(
    pools: Pools, world: int, degrees: dict[str, int], axis: str, groups: list[list[int]]
) -> None:
    results = pools(world).run(f"{M}:_body_gather_scatter_family", degrees, axis)
    n = len(groups[0])
    for rank, res in enumerate(results):
        members = _group(groups, rank)
        i = members.index(rank)

        gathered = torch.cat([_input(r, (2, 3)) for r in members])
        assert res["all_gather"] == gathered.tolist()
        assert res["all_gather_async"] == gathered.tolist()

        full = sum(_input(r, (2 * n, 3)) for r in members)
        assert isinstance(full, torch.Tensor)
        mine = full[2 * i : 2 * i + 2]
        assert res["rs_sum"] == mine.tolist()
        assert res["rs_avg"] == (mine / n).tolist()
        assert res["rs_avg_async"] == (mine / n).tolist()

        received = torch.cat(
            [_input(r, (2 * n, 2), torch.int64)[2 * i : 2 * i + 2] for r in members]
        )
        assert res["a2a"] == received.tolist()
        assert res["a2a_async"] == received.tolist()

        _check_stats(
            res["stats"],
            {
                "all_gather": (2, 2 * (n - 1) / n * (2 * n * 3 * 4)),
                "reduce_scatter": (3, 3 * (n - 1) / n * (2 * n * 3 * 4)),
                "all_to_all": (2, 2 * (n - 1) / n * (2 * n * 2 * 8)),
            },
            {"all_gather", "reduce_scatter", "all_to_all"},
        )


# ---------------------------------------------------------------- rooted collectives, barrier


def _body_rooted(ctx: WorkerContext, degrees: dict[str, int], axis: str) -> dict[str, Any]:
    mesh = ctx.mesh(**degrees)
    g = mesh.axis(axis)
    n = g.size
    last = n - 1
    out: dict[str, Any] = {}

    for src in (0, last):
        t = _input(ctx.rank, (5,))
        assert comm.broadcast(t, g, src=src) is None
        out[f"bcast{src}"] = t.tolist()
    t = _input(ctx.rank, (5,))
    h = comm.broadcast(t, g, src=last, async_op=True)
    assert h is not None
    h.wait()
    out["bcast_async"] = t.tolist()

    t = _input(ctx.rank, (5,))
    comm.reduce(t, g, dst=0)
    out["reduce_sum0"] = t.tolist() if g.index == 0 else None
    t = _input(ctx.rank, (5,))
    comm.reduce(t, g, dst=last, op="avg")
    out["reduce_avg_last"] = t.tolist() if g.index == last else None

    for dst in (0, last):
        got = comm.gather(_input(ctx.rank, (2, 2)), g, dst=dst)
        out[f"gather{dst}"] = None if got is None else [c.tolist() for c in got]

    for src in (0, last):
        buf = torch.full((3,), -99.0)
        chunks = None
        if g.index == src:
            chunks = [_input(ctx.rank, (3,)) + 100 * j for j in range(n)]
        comm.scatter(buf, g, chunks, src=src)
        out[f"scatter{src}"] = buf.tolist()

    comm.barrier(g)
    out["stats"] = _stats(mesh, axis, ["broadcast", "reduce", "gather", "scatter", "barrier"])
    return out


@pytest.mark.parametrize(("world", "degrees", "axis", "groups"), CASES)
def test_broadcast_reduce_gather_scatter_barrier(
    pools: Pools, world: int, degrees: dict[str, int], axis: str, groups: list[list[int]]
) -> None:
    results = pools(world).run(f"{M}:_body_rooted", degrees, axis)
    n = len(groups[0])
    last = n - 1
    for rank, res in enumerate(results):
        members = _group(groups, rank)
        i = members.index(rank)

        assert res["bcast0"] == _input(members[0], (5,)).tolist()
        assert res[f"bcast{last}"] == _input(members[last], (5,)).tolist()
        assert res["bcast_async"] == _input(members[last], (5,)).tolist()

        total = sum(_input(r, (5,)) for r in members)
        assert isinstance(total, torch.Tensor)
        assert res["reduce_sum0"] == (total.tolist() if i == 0 else None)
        assert res["reduce_avg_last"] == ((total / n).tolist() if i == last else None)

        pieces = [_input(r, (2, 2)).tolist() for r in members]
        assert res["gather0"] == (pieces if i == 0 else None)
        assert res[f"gather{last}"] == (pieces if i == last else None)

        for src in (0, last):
            assert res[f"scatter{src}"] == (_input(members[src], (3,)) + 100 * i).tolist()

        _check_stats(
            res["stats"],
            {
                "broadcast": (3, 3 * 5 * 4.0),
                "reduce": (2, 2 * 5 * 4.0),
                "gather": (2, 2 * (n - 1) / n * (n * 2 * 2 * 4)),
                "scatter": (2, 2 * (n - 1) / n * (n * 3 * 4)),
                "barrier": (1, 0.0),
            },
            {"broadcast", "reduce", "gather", "scatter", "barrier"},
        )


# ---------------------------------------------------------------- point to point

P2P_SHAPE = (4, 3)


def _body_p2p(ctx: WorkerContext, degrees: dict[str, int], axis: str) -> dict[str, Any]:
    mesh = ctx.mesh(**degrees)
    g = mesh.axis(axis)
    n, i = g.size, g.index
    nxt, prev = (i + 1) % n, (i - 1) % n
    x = _input(ctx.rank, P2P_SHAPE)
    out: dict[str, Any] = {}

    # blocking ring: even indices send first, odd ones receive first (n is even)
    buf = torch.zeros(P2P_SHAPE)
    if i % 2 == 0:
        comm.send(x, g, dst=nxt)
        comm.recv(buf, g, src=prev)
    else:
        comm.recv(buf, g, src=prev)
        comm.send(x, g, dst=nxt)
    out["sendrecv"] = buf.tolist()

    buf = torch.zeros(P2P_SHAPE)
    hr = comm.irecv(buf, g, src=prev)
    hs = comm.isend(x, g, dst=nxt)
    hs.wait()
    hr.wait()
    out["isend_irecv"] = buf.tolist()

    buf = torch.zeros(P2P_SHAPE)
    handles = comm.batch_isend_irecv([comm.P2P("send", x, nxt), comm.P2P("recv", buf, prev)], g)
    assert len(handles) == 2
    for h in handles:
        h.wait()
    out["batch"] = buf.tolist()
    assert comm.batch_isend_irecv([], g) == []
    out["stats"] = _stats(mesh, axis, ["send", "recv"])
    return out


@pytest.mark.parametrize(("world", "degrees", "axis", "groups"), CASES)
def test_point_to_point_ring(
    pools: Pools, world: int, degrees: dict[str, int], axis: str, groups: list[list[int]]
) -> None:
    results = pools(world).run(f"{M}:_body_p2p", degrees, axis)
    n = len(groups[0])
    nbytes = 4 * 3 * 4
    for rank, res in enumerate(results):
        members = _group(groups, rank)
        prev = members[(members.index(rank) - 1) % n]
        want = _input(prev, P2P_SHAPE).tolist()
        assert res["sendrecv"] == want
        assert res["isend_irecv"] == want
        assert res["batch"] == want
        _check_stats(
            res["stats"],
            {"send": (3, 3.0 * nbytes), "recv": (3, 3.0 * nbytes)},
            set(),
        )
        # the blocking recv at least waited; every op records non-negative time
        assert res["stats"]["ops"]["recv"]["seconds"] > 0.0


def _body_p2p_strided(ctx: WorkerContext, degrees: dict[str, int], axis: str) -> list[Any]:
    """Non-contiguous messages and receive buffers (transposed views) in every form."""
    mesh = ctx.mesh(**degrees)
    g = mesh.axis(axis)
    n, i = g.size, g.index
    nxt, prev = (i + 1) % n, (i - 1) % n
    x = _input(ctx.rank, P2P_SHAPE)
    msg = x.t()  # (3, 4), not contiguous
    assert not msg.is_contiguous()
    got = []

    buf = torch.zeros(P2P_SHAPE).t()
    if i % 2 == 0:
        comm.send(msg, g, dst=nxt)
        comm.recv(buf, g, src=prev)
    else:
        comm.recv(buf, g, src=prev)
        comm.send(msg, g, dst=nxt)
    got.append(buf.tolist())

    buf = torch.zeros(P2P_SHAPE).t()
    hr = comm.irecv(buf, g, src=prev)
    comm.isend(msg, g, dst=nxt).wait()
    hr.wait()
    got.append(buf.tolist())

    buf = torch.zeros(P2P_SHAPE).t()
    for h in comm.batch_isend_irecv([comm.P2P("send", msg, nxt), comm.P2P("recv", buf, prev)], g):
        h.wait()
    got.append(buf.tolist())
    got.append(mesh.stats.total_bytes(axis))
    return got


@pytest.mark.parametrize(("world", "degrees", "axis", "groups"), CASES)
def test_point_to_point_non_contiguous(
    pools: Pools, world: int, degrees: dict[str, int], axis: str, groups: list[list[int]]
) -> None:
    results = pools(world).run(f"{M}:_body_p2p_strided", degrees, axis)
    n = len(groups[0])
    for rank, res in enumerate(results):
        members = _group(groups, rank)
        want = _input(members[(members.index(rank) - 1) % n], P2P_SHAPE).t().tolist()
        assert res[:3] == [want, want, want]
        assert res[3] == 6 * 4 * 3 * 4  # three sends and three receives of 48 bytes


# ---------------------------------------------------------------- a group of one rank


def _body_size_one(ctx: WorkerContext) -> dict[str, Any]:
    mesh = ctx.mesh(dp=1, tp=ctx.world_size)
    g = mesh.axis("dp")
    assert g.size == 1 and g.pg is None and g.ranks == (ctx.rank,)
    return _size_one_ops(mesh, g, ctx.rank)


def _size_one_ops(mesh: Any, g: comm.AxisGroup, rank: int) -> dict[str, Any]:
    """Every collective on a one-rank group; returns results that must equal the input."""
    out: dict[str, Any] = {}
    x = _input(rank, (4, 2))
    for op in AR_OPS:
        t = x.clone()
        comm.all_reduce(t, g, op=op)
        out[f"all_reduce_{op}"] = t.tolist()
    t = x.clone()
    h = comm.all_reduce(t, g, op="avg", async_op=True)
    assert h is not None
    h.wait()
    out["all_reduce_async"] = t.tolist()
    out["all_gather"] = comm.all_gather(x, g).tolist()
    out["reduce_scatter"] = comm.reduce_scatter(x, g, op="avg").tolist()
    out["all_to_all"] = comm.all_to_all(x, g).tolist()
    t = x.clone()
    comm.broadcast(t, g, src=0)
    out["broadcast"] = t.tolist()
    t = x.clone()
    comm.reduce(t, g, dst=0, op="avg")
    out["reduce"] = t.tolist()
    got = comm.gather(x, g, dst=0)
    assert got is not None and len(got) == 1
    out["gather"] = got[0].tolist()
    buf = torch.zeros(4, 2)
    comm.scatter(buf, g, [x], src=0)
    out["scatter"] = buf.tolist()
    comm.barrier(g)
    ops = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]
    ops += ["reduce", "gather", "scatter", "barrier"]
    out["stats"] = _stats(mesh, g.name, ops)
    return out


def _check_size_one(res: dict[str, Any], rank: int) -> None:
    x = _input(rank, (4, 2)).tolist()
    for key, value in res.items():
        if key != "stats":
            assert value == x, key
    calls = {op: 1 for op in res["stats"]["ops"]}
    calls["all_reduce"] = len(AR_OPS) + 1
    _check_stats(res["stats"], {op: (c, 0.0) for op, c in calls.items()}, set())


@pytest.mark.parametrize("world", [2, 4])
def test_size_one_group_is_a_counted_no_op(pools: Pools, world: int) -> None:
    for rank, res in enumerate(pools(world).run(f"{M}:_body_size_one")):
        _check_size_one(res, rank)


def test_size_one_group_without_a_world() -> None:
    mesh = init_mesh()
    _check_size_one(_size_one_ops(mesh, mesh.axis("dp"), 0), 0)


# ---------------------------------------------------------------- input validation


def test_unknown_reduction_is_refused_before_counting() -> None:
    mesh = init_mesh()
    g = mesh.axis("dp")
    t = torch.ones(4)
    mean: Any = "mean"  # not a ReduceOp: bypasses the type checker on purpose
    with pytest.raises(ValueError, match="unknown reduction 'mean'"):
        comm.all_reduce(t, g, op=mean)
    with pytest.raises(ValueError, match="unknown reduction 'premul_sum'"):
        comm.reduce_scatter(t, g, op=cast(Any, "premul_sum"))
    with pytest.raises(ValueError, match="unknown reduction"):
        comm.reduce(t, g, op=mean)
    assert t.tolist() == [1.0] * 4
    assert mesh.stats.get("dp", "all_reduce").calls == 0
    assert mesh.stats.get("dp", "reduce_scatter").calls == 0
    assert mesh.stats.get("dp", "reduce").calls == 0
    assert mesh.stats.total_bytes() == 0.0


def test_bad_peers_and_scatter_chunks_are_refused() -> None:
    mesh = init_mesh()
    g = mesh.axis("tp")
    with pytest.raises(ValueError, match="peer index 1 outside axis 'tp' of size 1"):
        comm.send(torch.ones(2), g, dst=1)
    with pytest.raises(ValueError, match="the source needs 1 chunks"):
        comm.scatter(torch.zeros(2), g, None, src=0)
    with pytest.raises(ValueError, match="P2P kind"):
        comm.batch_isend_irecv([comm.P2P(cast(Any, "put"), torch.ones(1), 0)], g)
    assert mesh.stats.total_bytes() == 0.0


def _body_validation(ctx: WorkerContext, degrees: dict[str, int], axis: str) -> dict[str, Any]:
    mesh = ctx.mesh(**degrees)
    g = mesh.axis(axis)
    n = g.size
    mean: Any = "mean"
    avgs: Any = "avgs"
    errors = []
    for call in (
        lambda: comm.reduce_scatter(torch.ones(n + 1, 2), g),
        lambda: comm.reduce_scatter(torch.ones(n + 1), g, async_op=True),
        lambda: comm.all_to_all(torch.ones(2 * n + 1, 3), g),
        lambda: comm.all_reduce(torch.ones(3), g, op=mean),
        lambda: comm.reduce(torch.ones(3), g, op=avgs),
    ):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
        else:
            errors.append("no error")
    counted = {op: mesh.stats.get(axis, op).calls for op in ("reduce_scatter", "all_to_all")}
    counted["all_reduce"] = mesh.stats.get(axis, "all_reduce").calls
    counted["reduce"] = mesh.stats.get(axis, "reduce").calls
    # the group is still usable: no bad call reached the backend
    t = torch.tensor([float(ctx.rank)])
    comm.all_reduce(t, g)
    comm.barrier(g)
    return {"errors": errors, "counted": counted, "sum": t.item()}


@pytest.mark.parametrize(("world", "degrees", "axis", "groups"), CASES)
def test_shape_and_reduction_errors_leave_the_group_usable(
    pools: Pools, world: int, degrees: dict[str, int], axis: str, groups: list[list[int]]
) -> None:
    results = pools(world).run(f"{M}:_body_validation", degrees, axis)
    n = len(groups[0])
    for rank, res in enumerate(results):
        rs, rs_async, a2a, bad_op, bad_reduce = res["errors"]
        assert f"reduce_scatter on axis '{axis}'" in rs
        assert f"dim 0 ({n + 1}) is not divisible by the group size {n}" in rs
        assert f"dim 0 ({n + 1}) is not divisible" in rs_async
        assert f"all_to_all on axis '{axis}'" in a2a
        assert f"dim 0 ({2 * n + 1}) is not divisible by the group size {n}" in a2a
        assert "unknown reduction 'mean'" in bad_op
        assert "unknown reduction 'avgs'" in bad_reduce
        assert res["counted"] == {
            "reduce_scatter": 0,
            "all_to_all": 0,
            "all_reduce": 0,
            "reduce": 0,
        }
        assert res["sum"] == float(sum(_group(groups, rank)))


# ---------------------------------------------------------------- timeouts

TIMEOUT_S = 2.0


def _body_timeout(ctx: WorkerContext, kind: str) -> dict[str, Any] | None:
    mesh = ctx.mesh(dp=2, timeout_s=TIMEOUT_S)
    g = mesh.axis("dp")
    if ctx.rank == 1:
        return None  # never enters the operation
    t0 = time.monotonic()
    try:
        if kind == "all_reduce":
            comm.all_reduce(torch.ones(4), g)
        elif kind == "all_reduce_async":
            h = comm.all_reduce(torch.ones(4), g, async_op=True)
            assert h is not None
            h.wait()
        else:
            comm.recv(torch.zeros(4), g, src=1)
    except CommTimeoutError as e:
        return {
            "message": str(e),
            "rank": e.rank,
            "axis": e.axis,
            "op": e.op,
            "timeout_s": e.timeout_s,
            "is_timeout": isinstance(e, TimeoutError),
            "elapsed": time.monotonic() - t0,
        }
    return {"message": "no error"}


@pytest.mark.parametrize(
    ("kind", "op"),
    [("all_reduce", "all_reduce"), ("all_reduce_async", "all_reduce"), ("recv", "recv")],
)
def test_missing_peer_raises_comm_timeout(pools: Pools, kind: str, op: str) -> None:
    r0, r1 = pools(2).run(f"{M}:_body_timeout", kind, timeout_s=60.0, restart_after=True)
    assert r1 is None
    msg = r0["message"]
    assert "rank 0" in msg
    assert "mesh axis 'dp'" in msg
    assert op in msg
    assert (r0["rank"], r0["axis"], r0["op"], r0["timeout_s"]) == (0, "dp", op, TIMEOUT_S)
    assert r0["is_timeout"]
    # it fired from the group's own timeout, not the pool's 60 s one
    assert TIMEOUT_S * 0.5 <= r0["elapsed"] < 30.0
