"""Which piece of each parameter a rank holds, for Adafactor's statistics
(:class:`plait.optimizers.factored.Held`): ZeRO's flat shards and tensor-parallel blocks.

* a tensor-parallel parameter cut along a dimension (:class:`~plait.parallel.tensor.
  layers.TPShard`) is a block of the whole one: its sums are all-reduced over tp, the
  first replica of a replicated block counting; a tensor tp holds whole on every rank
  is not reduced over tp (each rank computes the same);
* an expert weight under expert parallelism (``(E/ep, ...)`` of ``(E, ...)``) is a block
  along dim 0: its sums (the parameter's and the update's RMS run over every expert) are
  all-reduced over ep;
* under ZeRO each unit's flat parameters are cut into equal shards over its shard group:
  a rank holds a flat range of each parameter's local tensor (maybe none), and every
  parameter of the unit is listed on every rank of the group (the ones it holds none
  of add zeros), so the all-reduced vectors line up.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from plait.comm import AxisGroup
from plait.mesh import Mesh
from plait.optimizers.factored import Held, Split
from plait.parallel.expert.apply import expert_split
from plait.parallel.tensor.layers import shard_info

if TYPE_CHECKING:
    from plait.parallel.zero.flat import FlatUnit


def is_block(p: torch.Tensor) -> bool:
    """Whether ``p`` is a block of a larger one-device tensor (cut over tp or ep)."""
    info, experts = shard_info(p), expert_split(p)
    return (info is not None and info.dim is not None and info.shards > 1) or (
        experts is not None and experts.shards > 1
    )


def block_split(p: torch.Tensor, mesh: Mesh) -> tuple[Split, AxisGroup, int] | None:
    """Where ``p``'s block sits in the whole tensor, the group holding the other blocks
    and the whole length along the split: its tensor-parallel block, or its experts
    under expert parallelism (None: held whole)."""
    info, experts = shard_info(p), expert_split(p)
    cut_experts = experts is not None and experts.shards > 1
    if info is not None and info.dim is not None and info.shards > 1:
        if cut_experts:
            raise ValueError("Adafactor: a tensor cut over both tp and ep is not supported")
        tp = mesh.axis("tp")
        offset = (tp.index // info.replicas) * info.block
        first = tp.index % info.replicas == 0  # a replicated block counts once
        return Split(info.dim, offset, info.shards * info.block, first), tp, info.full
    if experts is not None and cut_experts:
        ep = mesh.expert_axes(experts.shards)[0]
        offset = experts.index * experts.block
        return Split(0, offset, experts.full, True), ep, experts.full
    return None


def _held(
    p: torch.Tensor,
    local: tuple[int, ...],
    start: int,
    end: int,
    key: torch.Tensor | None,
    shard: AxisGroup | None,
    mesh: Mesh,
) -> Held:
    block = block_split(p, mesh)
    groups: tuple[AxisGroup, ...] = (shard,) if shard is not None else ()
    if block is None:
        return Held(local, local, start, end, None, groups, key)
    split, other, full = block
    whole = tuple(full if d == split.dim else n for d, n in enumerate(local))
    return Held(whole, local, start, end, split, (*groups, other), key)


def held_whole(params: Iterable[nn.Parameter], mesh: Mesh) -> list[Held]:
    """Each of ``params`` held whole on this rank (its tp block or its experts), keyed by
    itself."""
    return [_held(p, tuple(p.shape), 0, p.numel(), p, None, mesh) for p in params]


def held_in_unit(
    u: FlatUnit,
    segments: dict[int, torch.Tensor],
    stepped: set[int],
    shard: AxisGroup,
    mesh: Mesh,
) -> list[Held]:
    """Every parameter of ZeRO unit ``u`` that the optimizer steps (``stepped``: ids of
    the model parameters), with this rank's flat range of it and its optimizer segment
    (``segments``: the parameter's index in the unit -> the segment)."""
    out = []
    group = shard if shard.size > 1 else None
    for i, p in enumerate(u.params):
        if id(p) not in stepped:
            continue
        off, n = u.offsets[i], u.numels[i]
        a, b = max(off, u.lo), min(off + n, u.hi)
        start, end = (a - off, b - off) if a < b else (0, 0)
        out.append(_held(p, tuple(u.shapes[i]), start, end, segments.get(i), group, mesh))
    return out
