"""Muon over ZeRO's flat shards: one owner rank per matrix.

ZeRO cuts each unit's flat parameters into ``F`` equal shards, so a matrix's elements
lie on one or several ranks of the shard group. Muon's Newton-Schulz iteration needs the
whole matrix. Each Muon parameter (a 2-D matrix, or a 3-D expert stack) gets one *owner*
rank of its unit's shard group, chosen to balance the Newton-Schulz FLOPs over the ranks
(:func:`assign_owners`: largest first, to the least-loaded rank; Moonlight's distributed
Muon, Liu et al. 2025). One step (:meth:`MatrixOwners.__call__`):

1. every rank advances the momentum of its pieces (element-wise, so the momentum is
   optimizer state sharded exactly as ZeRO shards the masters: checkpoints save and
   reshard it like AdamW's moments) with its piece of the (clipped) gradient
   (:func:`plait.optimizers.muon.advance_momentum`);
2. **gather**: it sends its piece of each matrix's momentum update to the matrix's
   owner, one ``all_to_all_v`` per shard group through :mod:`plait.comm`; the owner
   concatenates the pieces (the shards are consecutive ranges of the flat unit, so in
   rank order they are the whole flattened matrix) and orthogonalises it
   (:func:`plait.optimizers.muon.orthogonalize`; a tensor-parallel piece is gathered
   whole over tp first);
3. **scatter**: the owner sends each rank its piece of the update (in the master dtype:
   a bf16 update is exact in it), a second ``all_to_all_v``;
4. every rank applies decay and update to its master piece
   (:func:`plait.optimizers.muon.apply_update`), element for element what one process
   does to the same elements.

Bytes leaving the ranks per step, over the whole group: ``2 · Σ_m (n_m - h_m) · e``
where ``n_m`` is matrix ``m``'s elements, ``h_m`` the elements its owner holds itself
and ``e`` the master element size (:func:`exchange_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait import comm
from plait.arch.arithmetic import newton_schulz_flops
from plait.comm import AxisGroup
from plait.optimizers.muon import advance_momentum, apply_update, matrix_shape, orthogonalize
from plait.optimizers.newton_schulz import adjust_lr
from plait.parallel.tensor.layers import shard_info
from plait.parallel.zero.flat import FlatUnit

if TYPE_CHECKING:
    from plait.parallel.zero.optim import ShardedMasters


@dataclass
class Matrix:
    """One Muon parameter of a flat unit."""

    unit: FlatUnit
    index: int  # the parameter's index in the unit
    group: int  # the index of its param group
    flops: int  # Newton-Schulz FLOPs of one step (every expert of a stack)
    full_shape: tuple[int, ...]  # the whole parameter's shape (across tp pieces)
    owner: int = 0  # index of the owner in the unit's shard group

    @property
    def start(self) -> int:
        """First element in the flat unit."""
        return self.unit.offsets[self.index]

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        return self.unit.numels[self.index]

    def piece(self, rank: int) -> tuple[int, int]:
        """``[a, b)`` of the parameter's flat elements (0-based within it) that shard
        ``rank`` holds (``a == b``: none)."""
        s = self.unit.shard_numel
        a = max(self.start, rank * s)
        b = min(self.start + self.numel, (rank + 1) * s)
        return (a - self.start, b - self.start) if a < b else (0, 0)


def whole_shape(p: torch.Tensor, local: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of parameter ``p`` across its tensor-parallel pieces (``local``: this
    rank's piece)."""
    info = shard_info(p)
    if info is None or info.dim is None:
        return local
    return tuple(info.full if d == info.dim else n for d, n in enumerate(local))


def assign_owners(flops: list[int], ranks: int) -> list[int]:
    """The owner of each of the items costing ``flops``: largest first, each to the
    rank with the least load so far (lowest index on ties); the most loaded rank then
    exceeds the mean by less than the largest item (Graham's bound)."""
    load = [0] * ranks
    owners = [0] * len(flops)
    for i in sorted(range(len(flops)), key=lambda i: (-flops[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += flops[i]
    return owners


def exchange_bytes(matrices: list[Matrix], element_size: int) -> int:
    """Bytes all the ranks of a shard group send in one step (gather and scatter)."""
    total = 0
    for m in matrices:
        a, b = m.piece(m.owner)
        total += 2 * (m.numel - (b - a)) * element_size
    return total


class MatrixOwners:
    """Muon's matrix step over ``masters`` (installed as
    :attr:`plait.optimizers.muon.Muon.matrix_step`; see the module docstring).

    Args:
        masters: the ZeRO masters whose inner optimizer is a Muon.
        muon_groups: indices of the Muon param groups.
        group_of: the param-group index of each model parameter.
        in_out: per Muon group, whether its 3-D tensors are ``(experts, in, out)``.
        ns_steps: Newton-Schulz iterations (for the owners' FLOPs).
    """

    def __init__(
        self,
        masters: ShardedMasters,
        muon_groups: set[int],
        group_of: dict[nn.Parameter, int],
        in_out: dict[int, bool],
        ns_steps: int,
    ) -> None:
        self.masters = masters
        zero = masters.zero
        self.by_group: dict[int, tuple[AxisGroup, list[Matrix]]] = {}
        for u in zero.units:
            shard = u.groups[0] if u.groups is not None else zero.shard_group
            for i, p in enumerate(u.params):
                gi = group_of.get(p)
                if gi is None or gi not in muon_groups:
                    continue
                shape = whole_shape(p, tuple(u.shapes[i]))
                count = shape[0] if len(shape) == 3 else 1
                flops = count * newton_schulz_flops(matrix_shape(shape, in_out[gi]), ns_steps)
                key = id(shard)
                mat = Matrix(u, i, gi, flops, shape)
                self.by_group.setdefault(key, (shard, []))[1].append(mat)
        for shard, mats in self.by_group.values():
            owners = assign_owners([m.flops for m in mats], shard.size)
            for m, owner in zip(mats, owners, strict=True):
                m.owner = owner
        self._slot = {id(s.unit): s for s in masters.slots}

    def matrices(self) -> list[Matrix]:
        """Every Muon matrix, in exchange order."""
        return [m for _, mats in self.by_group.values() for m in mats]

    def _local(self, m: Matrix, me: int) -> tuple[nn.Parameter, torch.Tensor] | None:
        """(optimizer segment, gradient piece) of ``m`` on shard ``me`` (the segment is
        a view of the master piece); None: none held."""
        a, b = m.piece(me)
        if a == b:
            return None
        slot = self._slot[id(m.unit)]
        lo = m.start + a - m.unit.lo  # shard coordinates
        for seg, s, e in slot.segments:
            if s == lo and e == lo + b - a:
                assert seg.grad is not None
                return seg, seg.grad
        raise RuntimeError(f"no optimizer segment for {m.unit.names[m.index]}")

    @torch.no_grad()
    def __call__(self, groups: list[dict[str, Any]]) -> None:
        """One Muon step of every matrix (gradients on the segments' ``.grad``)."""
        param_groups = self.masters.inner.param_groups
        for shard, mats in self.by_group.values():
            self._step_group(shard, mats, param_groups)

    def _step_group(
        self, g: AxisGroup, mats: list[Matrix], param_groups: list[dict[str, Any]]
    ) -> None:
        me, n = g.index, g.size
        dtype = self.masters.slots[0].master.dtype
        device = self.masters.slots[0].master.device
        inner = self.masters.inner
        local = {id(m): self._local(m, me) for m in mats}
        # 1. momentum of my pieces; 2. gather: my piece of each update to its owner
        sends = [[m for m in mats if m.owner == d] for d in range(n)]
        out = []
        for d in range(n):
            for m in sends[d]:
                held = local[id(m)]
                if held is None:
                    continue
                seg, grad = held
                state = inner.state[seg]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                out.append(advance_momentum(grad, state["momentum_buffer"], param_groups[m.group]))
        send_splits = [sum(m.piece(me)[1] - m.piece(me)[0] for m in sends[d]) for d in range(n)]
        mine = sends[me]
        recv_splits = [sum(m.piece(s)[1] - m.piece(s)[0] for m in mine) for s in range(n)]
        flat = torch.cat(out) if out else torch.zeros(0, dtype=dtype, device=device)
        got = comm.all_to_all_v(flat, g, send_splits, recv_splits).split(recv_splits)
        # the owner: whole updates, Newton-Schulz
        at = [0] * n
        updates: dict[int, torch.Tensor] = {}
        for m in mine:
            parts = []
            for s in range(n):
                a, b = m.piece(s)
                parts.append(got[s][at[s] : at[s] + b - a])
                at[s] += b - a
            u = torch.cat(parts).view(m.unit.shapes[m.index])
            pieces = inner.pieces_of(m.unit.params[m.index])  # type: ignore[attr-defined]
            o, _ = orthogonalize(u, param_groups[m.group], pieces)
            updates[id(m)] = o.to(dtype).reshape(-1)
        # 3. scatter: each rank's piece of each update back
        back = [updates[id(m)][slice(*m.piece(s))] for s in range(n) for m in mine]
        flat = torch.cat(back) if back else torch.zeros(0, dtype=dtype, device=device)
        got = comm.all_to_all_v(flat, g, recv_splits, send_splits).split(send_splits)
        # 4. every rank: decay and update on its master pieces
        for d in range(n):
            at_d = 0
            for m in sends[d]:
                a, b = m.piece(me)
                held = local[id(m)]
                if held is not None:
                    group = param_groups[m.group]
                    shape = m.full_shape
                    shape = matrix_shape(shape, group["in_out"])
                    lr_adj = adjust_lr(group["lr"], group["adjust_lr_fn"], shape)
                    o = got[d][at_d : at_d + b - a]
                    apply_update(held[0].data, o, group["lr"], group["weight_decay"], lr_adj)
                at_d += b - a
