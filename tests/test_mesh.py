"""The device mesh: rank arithmetic of MeshLayout, and real process groups on 2, 4, 8 ranks.

The pure tests check MeshLayout against the rank formula of the mesh.py docstring,
written out here; the multi-process tests check that every rank's Mesh agrees with
MeshLayout and that an all-reduce over each group sums exactly that group's members
(so the groups connect the ranks they claim to).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from plait import AXES, ConfigError, MeshLayout, comm, init_mesh
from plait.testing import WorkerContext, WorkerPool

M = "tests.test_mesh"
Pools = Callable[[int], WorkerPool]

LAYOUTS = [
    {},
    {"dp": 2},
    {"tp": 2},
    {"dp": 8},
    {"dp": 2, "tp": 2, "pp": 2},
    {"pp": 2, "tp": 4},
    {"dp": 4, "tp": 2},
    {"cp": 2, "tp": 2, "dp": 2},
    {"pp": 2, "cp": 2},
]
AXIS_SETS: list[tuple[str, ...]] = [(a,) for a in AXES] + [("dp", "cp")]


def _formula_rank(layout: dict[str, int], c: dict[str, int]) -> int:
    dp, cp, tp = (layout.get(a, 1) for a in ("dp", "cp", "tp"))
    return ((c["pp"] * dp + c["dp"]) * cp + c["cp"]) * tp + c["tp"]


def _ids(layout: dict[str, int]) -> str:
    return "".join(f"{a}{d}" for a, d in layout.items()) or "one"


# ---------------------------------------------------------------- pure arithmetic


@pytest.mark.parametrize("degrees", LAYOUTS, ids=_ids)
def test_coords_round_trip_and_rank_formula(degrees: dict[str, int]) -> None:
    layout = MeshLayout(**degrees)
    world = math.prod(degrees.values())
    assert layout.world_size == world
    assert layout.shape == tuple(degrees.get(a, 1) for a in ("pp", "dp", "cp", "tp"))
    seen = set()
    for r in range(world):
        c = layout.coords(r)
        assert list(c) == list(AXES)
        assert all(0 <= c[a] < degrees.get(a, 1) for a in AXES)
        assert layout.rank_of(**c) == r
        assert _formula_rank(degrees, c) == r
        seen.add(tuple(c.values()))
    assert len(seen) == world  # every coordinate is used exactly once
    # every coordinate tuple maps back to the rank whose coords it is
    for combo in itertools.product(*(range(degrees.get(a, 1)) for a in AXES)):
        c = dict(zip(AXES, combo, strict=True))
        assert layout.coords(layout.rank_of(**c)) == c
    # tp varies fastest, pp slowest
    tp, pp = degrees.get("tp", 1), degrees.get("pp", 1)
    for r in range(world):
        assert layout.coords(r)["tp"] == r % tp
        assert layout.coords(r)["pp"] == r // (world // pp)
    # missing axes default to 0
    assert layout.rank_of() == 0


def test_world_of_one() -> None:
    layout = MeshLayout()
    assert layout.world_size == 1
    assert layout.coords(0) == dict.fromkeys(AXES, 0)
    assert layout.rank_of(dp=0, tp=0) == 0
    for axes in AXIS_SETS:
        assert layout.group_of(0, axes) == [0]
        assert layout.groups(axes) == [[0]]


@pytest.mark.parametrize("degrees", LAYOUTS, ids=_ids)
@pytest.mark.parametrize("axes", AXIS_SETS, ids="-".join)
def test_groups_partition_the_world(degrees: dict[str, int], axes: tuple[str, ...]) -> None:
    layout = MeshLayout(**degrees)
    world = layout.world_size
    size = math.prod(degrees.get(a, 1) for a in axes)
    groups = layout.groups(axes)
    assert sorted(r for g in groups for r in g) == list(range(world))
    assert len(groups) == world // size
    assert all(len(g) == size for g in groups)
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)  # listed in rank order
    ordered = [a for a in AXES if a in axes]
    others = [a for a in AXES if a not in axes]
    for g in groups:
        coords = [layout.coords(r) for r in g]
        # members share every coordinate except along ``axes`` ...
        for a in others:
            assert len({c[a] for c in coords}) == 1
        # ... and are ordered by their coordinates along ``axes`` (grid order)
        keys = [tuple(c[a] for a in ordered) for c in coords]
        assert keys == list(itertools.product(*(range(degrees.get(a, 1)) for a in ordered)))
        for r in g:
            assert layout.group_of(r, axes) == g


def test_group_of_examples() -> None:
    layout = MeshLayout(dp=2, tp=2, pp=2)  # rank = (pp*2 + dp)*2 + tp
    assert layout.group_of(5, ("tp",)) == [4, 5]
    assert layout.group_of(5, ("dp",)) == [5, 7]
    assert layout.group_of(5, ("pp",)) == [1, 5]
    assert layout.group_of(5, ("cp",)) == [5]
    assert layout.group_of(5, ("tp", "dp")) == [4, 5, 6, 7]  # order of names is irrelevant
    assert layout.groups(("dp",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert MeshLayout(cp=2, tp=2, dp=2).group_of(1, ("dp", "cp")) == [1, 3, 5, 7]


def test_layout_errors() -> None:
    with pytest.raises(ConfigError, match="dp=0 must be >= 1"):
        MeshLayout(dp=0)
    with pytest.raises(ValueError, match="tp=-1 must be >= 1"):
        MeshLayout(tp=-1)
    for axis in ("pp", "cp"):
        with pytest.raises(ConfigError, match=f"{axis}=0"):
            MeshLayout(**{axis: 0})
    layout = MeshLayout(dp=2, tp=2)
    with pytest.raises(ValueError, match="unknown mesh axis 'ep'"):
        layout.group_of(0, ("ep",))
    with pytest.raises(ValueError, match="unknown mesh axis 'x'"):
        layout.groups(("dp", "x"))
    with pytest.raises(ValueError, match="rank 4 outside a mesh of 4 ranks"):
        layout.coords(4)
    with pytest.raises(ValueError, match="rank -1 outside"):
        layout.coords(-1)
    with pytest.raises(ValueError, match="coordinate tp=2 outside degree 2"):
        layout.rank_of(tp=2)
    with pytest.raises(ValueError, match="coordinate pp=1 outside degree 1"):
        layout.rank_of(pp=1)
    with pytest.raises(ValueError, match="coordinate dp=-1"):
        layout.rank_of(dp=-1)
    with pytest.raises(ValueError, match="rank 4 outside"):
        layout.group_of(4, ("dp",))


# ---------------------------------------------------------------- one process, no world


def test_init_mesh_without_a_world_is_one_rank() -> None:
    assert not comm.world_initialized()
    mesh = init_mesh()
    assert mesh.world_size == 1 and mesh.rank == 0
    assert mesh.layout == MeshLayout()
    assert mesh.coords == dict.fromkeys(AXES, 0)
    for a in AXES:
        assert mesh.size(a) == 1 and mesh.index(a) == 0
        g = mesh.axis(a)
        assert (g.name, g.ranks, g.index, g.size, g.pg) == (a, (0,), 0, 1, None)
    assert mesh.axis("dp", "cp").name == "dp_cp"
    assert mesh.axis("cp", "dp") is mesh.axis("dp", "cp")
    assert mesh.world().ranks == (0,)
    t = torch.arange(6.0)
    for op in ("sum", "avg", "max", "min", "product"):
        comm.all_reduce(t, mesh.axis("dp"), op=op)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    s = mesh.stats.get("dp", "all_reduce")
    assert (s.calls, s.bytes) == (5, 0.0)
    assert mesh.stats.total_bytes() == 0.0
    assert "rank 0" in mesh.describe()
    with pytest.raises(ValueError, match="unknown mesh axis 'ep'"):
        mesh.axis("ep")
    with pytest.raises(ValueError, match="at least one mesh axis"):
        mesh.axis()
    with pytest.raises(ValueError, match="unknown mesh axis"):
        mesh.size("x")


def test_init_mesh_without_a_world_refuses_more_ranks() -> None:
    with pytest.raises(ConfigError, match=r"dp=2 x tp=1 x pp=1 x cp=1 = 2 ranks .*world size 1"):
        init_mesh(dp=2)
    with pytest.raises(ConfigError, match=r"= 3 does not divide the world size 1"):
        init_mesh(tp=3)


def test_init_mesh_under_a_launcher_refuses_a_bad_layout_before_joining(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun's variables describe a world of 4; tp=3 is refused with the numbers
    before any rendezvous (which would wait for three ranks that never come)."""
    env = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert comm.launched_world() == (0, 4)
    with pytest.raises(ConfigError, match=r"does not divide the world size 4"):
        init_mesh(tp=3)
    assert not comm.world_initialized()
    monkeypatch.delenv("MASTER_PORT")
    assert comm.launched_world() is None  # an incomplete description is no launcher


def _body_refuse(ctx: WorkerContext) -> list[tuple[str, str]]:
    out = []
    for degrees in ({"dp": 3}, {"tp": 3}, {"dp": 2, "tp": 1}, {"dp": 0, "tp": 4}):
        try:
            init_mesh(**degrees)
        except ConfigError as e:
            out.append((type(e).__name__, str(e)))
        else:
            out.append(("no error", ""))
    return out


def test_init_mesh_refuses_a_product_that_is_not_the_world(pools: Pools) -> None:
    for res in pools(4).run(f"{M}:_body_refuse"):
        (k3, dp3), (kt, tp3), (k2, dp2), (k0, dp0) = res
        assert (k3, kt, k2, k0) == ("ConfigError",) * 4
        assert "dp=3 x tp=1 x pp=1 x cp=1 = 3 ranks" in dp3
        assert "world size 4" in dp3 and "whose product is 4" in dp3
        assert "tp=3 x pp=1 x cp=1 = 3 does not divide the world size 4" in tp3
        assert "= 2 ranks" in dp2 and "world size 4" in dp2
        assert "dp=0" in dp0


# ---------------------------------------------------------------- real groups

COMBOS: list[tuple[str, ...]] = [*AXIS_SETS, ("pp", "tp"), AXES]


def _body_layouts(ctx: WorkerContext, layouts: list[dict[str, int]]) -> list[dict[str, Any]]:
    out = []
    for degrees in layouts:
        mesh = ctx.mesh(**degrees)
        res: dict[str, Any] = {"coords": mesh.coords, "rank": mesh.rank, "groups": {}}
        for axes in COMBOS:
            g = mesh.axis(*axes)
            t = torch.tensor([float(ctx.rank), 1.0], dtype=torch.float64)
            comm.all_reduce(t, g)
            res["groups"]["-".join(axes)] = {
                "ranks": list(g.ranks),
                "index": g.index,
                "size": g.size,
                "sizes": [mesh.size(a) for a in axes],
                "indices": [mesh.index(a) for a in axes],
                "sum": t[0].item(),
                "count": t[1].item(),
            }
        res["world"] = list(mesh.world().ranks)
        out.append(res)
    return out


def _check_layouts(results: list[list[dict[str, Any]]], layouts: list[dict[str, int]]) -> None:
    for rank, per_layout in enumerate(results):
        for degrees, res in zip(layouts, per_layout, strict=True):
            layout = MeshLayout(**degrees)
            assert res["rank"] == rank
            assert res["coords"] == layout.coords(rank)
            assert res["world"] == list(range(layout.world_size))
            for axes in COMBOS:
                got = res["groups"]["-".join(axes)]
                members = layout.group_of(rank, axes)
                assert got["ranks"] == members, (degrees, axes)
                assert got["index"] == members.index(rank)
                assert got["size"] == len(members) == math.prod(got["sizes"])
                assert got["sizes"] == [degrees.get(a, 1) for a in axes]
                assert got["indices"] == [layout.coords(rank)[a] for a in axes]
                if len(axes) == 1:
                    assert got["index"] == layout.coords(rank)[axes[0]]
                # the all-reduce really ran over exactly these ranks
                assert got["sum"] == float(sum(members)), (degrees, axes)
                assert got["count"] == float(len(members))


@pytest.mark.parametrize(
    ("world", "layouts"),
    [
        (2, [{"dp": 2}, {"dp": 1, "tp": 2}, {"dp": 1, "pp": 2}, {"dp": 1, "cp": 2}]),
        (
            4,
            [
                {"dp": 4},
                {"dp": 2, "tp": 2},
                {"dp": 1, "pp": 2, "tp": 2},
                {"dp": 2, "cp": 2},
                {"dp": 1, "pp": 2, "cp": 2},
                {"dp": 1, "tp": 4},
            ],
        ),
        (
            8,
            [
                {"dp": 2, "tp": 2, "pp": 2},
                {"dp": 2, "cp": 2, "tp": 2},
                {"dp": 1, "pp": 2, "tp": 4},
                {"dp": 8},
            ],
        ),
    ],
    ids=["w2", "w4", "w8"],
)
def test_mesh_groups_connect_the_right_ranks(
    pools: Pools, world: int, layouts: list[dict[str, int]]
) -> None:
    results = pools(world).run(f"{M}:_body_layouts", layouts, timeout_s=180.0)
    _check_layouts(results, layouts)


def test_split_group_over_combined_axes() -> None:
    """ZeRO under context parallelism shards over dp x cp: the combined group, split by
    a hybrid factor, in grid order (cp faster than dp)."""
    from plait.mesh import MeshLayout

    lay = MeshLayout(dp=2, cp=2, tp=2)  # rank = (dp_i·2 + cp_i)·2 + tp_i
    assert lay.group_of(0, ("dp", "cp")) == [0, 2, 4, 6]
    assert lay.split_group_of(2, ("dp", "cp"), 4) == ([0, 2, 4, 6], [2])
    assert lay.split_group_of(2, ("dp", "cp"), 2) == ([0, 2], [2, 6])
    assert lay.split_group_of(5, ("dp", "cp"), 1) == ([5], [1, 3, 5, 7])
