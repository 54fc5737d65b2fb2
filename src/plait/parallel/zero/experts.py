"""ZeRO units of expert weights under expert parallelism: their own groups.

Each ep rank holds other experts; the ranks of an expert replica group
(:meth:`~plait.mesh.Mesh.expert_axes`) hold the same ones. :class:`~plait.parallel.zero.
ZeroDataParallel` moves the expert weights of every unit into a unit of their own
(:func:`~plait.parallel.zero.flat.split_expert_units`) whose :attr:`FlatUnit.groups` are
the replica group's (:func:`expert_unit_groups`): sharded over it at stages 1-3,
replicated over it at stage 0, and whose averaged gradient is scaled by
``replica ranks / data ranks`` (:attr:`FlatUnit.grad_scale`): the gradient of the global
batch's mean loss is the replicas' sum divided by all the data ranks. Reductions,
gathers and buckets read a unit's groups from the unit (docs/moe.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait import comm
from plait.comm import AxisGroup
from plait.parallel.zero.flat import FlatUnit, UnitSpec, split_expert_units


def expert_unit_groups(replica: AxisGroup, stage: int) -> tuple[AxisGroup, AxisGroup]:
    """(shard, replicate) groups of the expert units: sharded over the expert replica
    group at stages 1-3, replicated over it at stage 0; the other is this rank alone."""
    me = comm.new_axis_group(
        f"{replica.name}_self", (replica.rank,), replica.rank, replica.timeout_s, replica.stats
    )
    return (replica, me) if stage >= 1 else (me, replica)


def make_units(
    specs: list[UnitSpec],
    factor: int,
    shard_index: int,
    experts: set[int],
    expert_groups: tuple[AxisGroup, AxisGroup] | None,
    data: AxisGroup,
) -> list[FlatUnit]:
    """The flat units of ``specs``: sharded ``factor`` ways (this rank's index
    ``shard_index``), except, with ``expert_groups``, the expert weights (ids in
    ``experts``), moved to units of their own over those groups. ``data``: the ranks
    the gradients average over."""
    if expert_groups is None:
        return [FlatUnit(i, s, factor, shard_index) for i, s in enumerate(specs)]
    own, rep = expert_groups
    units = []
    for i, s in enumerate(split_expert_units(specs, experts)):
        if id(s.params[0]) not in experts:
            units.append(FlatUnit(i, s, factor, shard_index))
            continue
        u = FlatUnit(i, s, own.size, own.index)
        u.groups = expert_groups  # the same tuple: buckets never mix the two kinds
        u.grad_scale = own.size * rep.size / data.size  # replica ranks / data ranks
        units.append(u)
    return units


def local_experts_as_they_are(
    init: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``init`` for a meta-built model whose expert weights expert parallelism already
    allocated (their ``E/ep`` experts): those keep their values, the rest come from
    ``init``."""

    def value(p: torch.Tensor) -> torch.Tensor:
        return p.detach().cpu() if not p.is_meta else init(p)

    return value
