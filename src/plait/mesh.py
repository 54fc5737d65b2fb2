"""The device mesh: named axes dp, pp, cp, tp over one grid of ranks.

Ranks are laid out in the grid ``(pp, dp, cp, tp)`` in row-major order, so ``tp`` is the
fastest-varying axis (tensor-parallel peers are neighbours, on one node when the world
spans several) and ``pp`` the slowest::

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

:class:`MeshLayout` is the pure arithmetic (no processes); :class:`Mesh` adds this rank's
process groups, one per axis and per combination of axes asked for (``mesh.axis("dp",
"cp")``), all sharing one :class:`~plait.comm.CommStats`. One rank is the same code path
with every degree 1.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field

import torch

from plait import comm
from plait.comm import AxisGroup, CommStats
from plait.config.rules.layout import check_world
from plait.errors import ConfigError

AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")
"""Axis names in grid order, slowest-varying first."""


@dataclass(frozen=True)
class MeshLayout:
    """Degrees of the four axes; pure rank arithmetic."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in AXES:
            if getattr(self, name) < 1:
                raise ConfigError(f"mesh degree {name}={getattr(self, name)} must be >= 1")

    @property
    def shape(self) -> tuple[int, ...]:
        """Degrees in grid order (pp, dp, cp, tp)."""
        return tuple(getattr(self, a) for a in AXES)

    @property
    def world_size(self) -> int:
        """Product of the degrees."""
        return math.prod(self.shape)

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` along every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a mesh of {self.world_size} ranks")
        out: dict[str, int] = {}
        rest = rank
        for name, size in zip(reversed(AXES), reversed(self.shape), strict=True):
            out[name] = rest % size
            rest //= size
        return {a: out[a] for a in AXES}

    def rank_of(self, **coords: int) -> int:
        """The rank at the given coordinates (missing axes are 0)."""
        rank = 0
        for name, size in zip(AXES, self.shape, strict=True):
            c = coords.get(name, 0)
            if not 0 <= c < size:
                raise ValueError(f"coordinate {name}={c} outside degree {size}")
            rank = rank * size + c
        return rank

    def group_of(self, rank: int, axes: tuple[str, ...]) -> list[int]:
        """The ranks that share every coordinate of ``rank`` except along ``axes``,
        ordered by their coordinates along ``axes`` (in grid order)."""
        bad = [a for a in axes if a not in AXES]
        if bad:
            raise ValueError(f"unknown mesh axis {bad[0]!r}; axes are {', '.join(AXES)}")
        mine = self.coords(rank)
        ordered = [a for a in AXES if a in axes]
        ranges = [range(getattr(self, a)) for a in ordered]
        members = []
        for combo in itertools.product(*ranges):
            c = dict(mine)
            c.update(zip(ordered, combo, strict=True))
            members.append(self.rank_of(**c))
        return members

    def split_group_of(
        self, rank: int, axis: str | tuple[str, ...], factor: int
    ) -> tuple[list[int], list[int]]:
        """Split ``rank``'s group along ``axis`` (one axis or a combination, e.g.
        ``("dp", "cp")``) into (shard, replicate) sub-groups.

        The shard group holds ``factor`` consecutive coordinates of the axis (the block
        that contains ``rank``); the replicate group holds the ranks at the same position
        in every block. Used by hybrid sharding (ZeRO with a sharding factor F): shard
        inside groups of F, replicate across the ``size / F`` groups.
        """
        axes = (axis,) if isinstance(axis, str) else axis
        members = self.group_of(rank, axes)
        size = len(members)
        if factor < 1 or size % factor:
            raise ConfigError(
                f"a sharding factor of {factor} does not divide the {'x'.join(axes)} degree "
                f"{size}; "
                f"choose one of {[f for f in range(1, size + 1) if size % f == 0]}"
            )
        i = members.index(rank)
        block = i // factor
        return members[block * factor : (block + 1) * factor], members[i % factor :: factor]

    def groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every group of the combination ``axes``, each listed once, in rank order."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(tuple(self.group_of(r, axes)), None)
        return [list(g) for g in seen]


def _axis_key(axes: tuple[str, ...]) -> tuple[str, ...]:
    if not axes:
        raise ValueError("name at least one mesh axis")
    bad = [a for a in axes if a not in AXES]
    if bad:
        raise ValueError(f"unknown mesh axis {bad[0]!r}; axes are {', '.join(AXES)}")
    return tuple(a for a in AXES if a in axes)


@dataclass
class Mesh:
    """This rank's view of the mesh: layout, coordinates, process groups, counters."""

    layout: MeshLayout
    rank: int
    timeout_s: float
    device: torch.device
    stats: CommStats = field(default_factory=CommStats)
    _groups: dict[tuple[str, ...], AxisGroup] = field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        """Number of ranks in the mesh."""
        return self.layout.world_size

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinate along every axis."""
        return self.layout.coords(self.rank)

    def size(self, name: str) -> int:
        """Degree of one axis."""
        _axis_key((name,))
        return int(getattr(self.layout, name))

    def index(self, name: str) -> int:
        """This rank's coordinate along one axis."""
        return self.coords[name]

    def axis(self, *names: str) -> AxisGroup:
        """The group of this rank along ``names`` (one axis or several, e.g. "dp", "cp").

        Groups are created on first use; every member must ask for the same group at the
        same point of the program (which SPMD code does naturally).
        """
        key = _axis_key(names)
        g = self._groups.get(key)
        if g is None:
            members = self.layout.group_of(self.rank, key)
            g = comm.new_axis_group("_".join(key), members, self.rank, self.timeout_s, self.stats)
            self._groups[key] = g
        return g

    def split_axis(self, name: str | tuple[str, ...], factor: int) -> tuple[AxisGroup, AxisGroup]:
        """(shard group, replicate group) of this rank for a sharding factor along ``name``
        (one axis, or a combination such as ``("dp", "cp")``: ZeRO under context
        parallelism shards over dp x cp, whose ranks hold the same parameters).

        See :meth:`MeshLayout.split_group_of`. When ``factor`` is the axis degree the shard
        group is the axis group itself (and the replicate group has one rank); when it is 1
        the replicate group is the axis group. Otherwise the groups are named
        ``<axis>_shard`` and ``<axis>_replicate`` in the counters. Created on first use by
        their members only (local synchronisation), shard group first.
        """
        axes = _axis_key((name,) if isinstance(name, str) else name)
        size = math.prod(self.size(a) for a in axes)
        shard_members, rep_members = self.layout.split_group_of(self.rank, axes, factor)
        out: list[AxisGroup] = []
        for kind, members in (("shard", shard_members), ("replicate", rep_members)):
            if len(members) == size:
                out.append(self.axis(*axes))
                continue
            key = (*axes, f"{kind}{factor}")
            g = self._groups.get(key)
            if g is None:
                label = "_".join(axes)
                g = comm.new_axis_group(
                    f"{label}_{kind}", members, self.rank, self.timeout_s, self.stats
                )
                self._groups[key] = g
            out.append(g)
        return out[0], out[1]

    def expert_axes(self, ep: int) -> tuple[AxisGroup, AxisGroup]:
        """(ep group, expert replica group) of this rank for expert parallelism of degree
        ``ep``: the sub-axis of the dp x cp ranks (in their grid order) that splits the
        experts, blocks of ``ep`` consecutive ranks, and the ranks at the same position
        in every block, which hold the same experts and reduce their gradients. Named
        ``ep`` and ``ep_replica`` in the counters; created on first use by their members
        (ep group first). ``ep`` must divide dp x cp (:class:`ConfigError` otherwise)."""
        data = self.size("dp") * self.size("cp")
        if ep < 1 or data % ep:
            raise ConfigError(
                f"parallel.ep ({ep}) must divide the data-parallel ranks dp x cp = {data}"
            )
        shard, rep = self.layout.split_group_of(self.rank, ("dp", "cp"), ep)
        out: list[AxisGroup] = []
        for label, members in (("ep", shard), ("ep_replica", rep)):
            key = (label, str(ep))
            g = self._groups.get(key)
            if g is None:
                g = comm.new_axis_group(label, members, self.rank, self.timeout_s, self.stats)
                self._groups[key] = g
            out.append(g)
        return out[0], out[1]

    def world(self) -> AxisGroup:
        """The group of every rank of the mesh."""
        return self.axis(*AXES)

    def describe(self) -> str:
        """One line: degrees and this rank's coordinates."""
        degrees = " x ".join(f"{a}{getattr(self.layout, a)}" for a in AXES)
        coords = ", ".join(f"{a}={c}" for a, c in self.coords.items())
        return f"mesh {degrees} ({self.world_size} ranks); rank {self.rank}: {coords}"


def init_mesh(
    dp: int | None = None,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    *,
    timeout_s: float = 300.0,
    device: torch.device | str | None = None,
) -> Mesh:
    """Build the mesh of this process over its world.

    Under ``torchrun`` (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT) with no process group yet, it joins the launcher's world first, as
    ``torch.distributed.device_mesh.init_device_mesh`` does: NCCL when ``device`` is
    CUDA (``"cuda"`` alone means this process's ``LOCAL_RANK`` device), gloo otherwise.
    A world joined before (``init_process_group``, a test pool) is used as it is.
    Without a launcher the mesh has one rank and no process groups.

    ``dp`` defaults to the world size divided by ``tp * pp * cp``. Degrees whose product
    is not the world size are refused with the numbers (before joining a world).
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    launched = comm.launched_world()
    if launched is not None and not comm.world_initialized():
        check_world(dp, tp, pp, cp, launched[1])  # refuse a bad layout before joining
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        comm.join_launched_world(dev.type, timeout_s=timeout_s)
    world = comm.world_size()
    rank = comm.world_rank()
    layout = MeshLayout(dp=check_world(dp, tp, pp, cp, world), pp=pp, cp=cp, tp=tp)
    mesh = Mesh(layout=layout, rank=rank, timeout_s=timeout_s, device=dev)
    for name in AXES:  # every rank creates its single-axis groups in the same order
        mesh.axis(name)
    return mesh
