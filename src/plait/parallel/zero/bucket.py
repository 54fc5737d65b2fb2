"""ZeRO-1/2 buckets: units fused into one reduce-scatter and one all-gather.

Stages 1 and 2 hold full parameters, so nothing forces a collective per unit: with
``bucket_mb`` (DataParallel's bucket size) consecutive units, in backward order, form a
:class:`GradBucket` whose gradients go out in one reduce-scatter (launched by
:class:`~plait.parallel.zero.reducer.GradientReducer` when the bucket's last unit is
complete) and whose updated shards come back in one all-gather after the step
(:class:`ParamSync`). Without ``bucket_mb`` every unit is a bucket of its own. The bytes
on the wire are the same either way; only the number of calls changes.

Stage 2 writes each gradient straight into its bucket's reduce-scatter input
(:meth:`GradBucket.write`), a buffer of a :class:`BufferRing` kept across steps.

:class:`ParamSync` launches the post-step all-gathers and leaves them in flight; the
wrapper completes a unit's (its bucket's) just before the unit's next forward, so the
gathers of later units overlap the forward of earlier ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from plait import comm
from plait.comm import AxisGroup
from plait.parallel.zero.flat import FlatUnit

if TYPE_CHECKING:
    from plait.parallel.zero.unit_reduction import UnitReduction


class GradBucket:
    """Consecutive units (in backward order) whose gradients are reduce-scattered in one
    call (stages 1/2 with ``bucket_mb``). The flat ``(F · width,)`` input is laid out as
    F rows of ``width`` = the units' shard sizes side by side: row r holds chunk r of
    every unit, so the rank-r output of one reduce-scatter is every unit's r-th shard,
    unit ``k``'s at columns ``[cols[k], cols[k] + shard_numel)``."""

    def __init__(self, units: list[UnitReduction]) -> None:
        self.units = units
        self.cols: list[int] = []
        width = 0
        for r in units:
            self.cols.append(width)
            width += r.unit.shard_numel
        self.width = width
        self.done: set[int] = set()  # unit indices whose gradients are complete
        self.buffer: torch.Tensor | None = None  # (F * width,) while in flight

    @property
    def names(self) -> str:
        return "+".join(r.unit.name for r in self.units)

    @property
    def numel(self) -> int:
        """Elements of the ``(F * width,)`` reduce-scatter input."""
        return self.units[0].unit.shard_count * self.width if self.units else 0

    def _runs(self, k: int, start: int, n: int) -> list[tuple[int, int, int, int]]:
        """Where elements ``[start, start + n)`` of unit ``k``'s flat ``(padded,)`` layout
        sit in the ``(F, width)`` grid: ``(row, grid column, source offset, length)`` runs
        (a run per shard the range touches)."""
        s, col = self.units[k].unit.shard_numel, self.cols[k]
        out, pos, end = [], start, start + n
        while pos < end:
            row, within = divmod(pos, s)
            length = min(end, (row + 1) * s) - pos
            out.append((row, col + within, pos - start, length))
            pos += length
        return out

    def write(self, k: int, i: int, grad: torch.Tensor | None) -> None:
        """Put parameter ``i`` of unit ``k``'s gradient (None: zeros) in its place in
        :attr:`buffer` (stage 2's kept buffers: no per-unit full-gradient copy)."""
        assert self.buffer is not None
        u = self.units[k].unit
        grid = self.buffer.view(u.shard_count, self.width)
        src = None if grad is None else grad.reshape(-1)
        for row, c, off, n in self._runs(k, u.offsets[i], u.numels[i]):
            if src is None:
                grid[row, c : c + n].zero_()
            else:
                grid[row, c : c + n].copy_(src[off : off + n])

    def zero_padding(self) -> None:
        """Zero the padding of every unit in :attr:`buffer` (a reused buffer holds the
        last bucket's values there)."""
        assert self.buffer is not None
        for k, r in enumerate(self.units):
            u = r.unit
            if u.padded > u.numel:
                grid = self.buffer.view(u.shard_count, self.width)
                for row, c, _, n in self._runs(k, u.numel, u.padded - u.numel):
                    grid[row, c : c + n].zero_()


class BufferRing:
    """Stage 2's gradient buffers, kept across steps. A bucket takes one at its first
    gradient (:meth:`take`: the smallest free buffer that fits) and gives it back once
    its reduce-scatter has completed (:meth:`give`). At most ``slots`` buffers are
    allocated, each of ``numel`` elements (the largest bucket), or, with ``numel`` None
    and a slot per bucket, one of each bucket's own size: the storage is the same from
    step to step, as DataParallel's buckets, while the bytes kept are
    ``min(K · largest bucket, every bucket)`` for K = ``MAX_REDUCES_IN_FLIGHT + 1``."""

    def __init__(
        self, slots: int, numel: int | None, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.slots, self.numel, self.dtype, self.device = slots, numel, dtype, device
        self._all: list[torch.Tensor] = []
        self._free: list[torch.Tensor] = []

    @property
    def kept_bytes(self) -> int:
        """Bytes of every buffer allocated (in use or free)."""
        return sum(t.numel() * t.element_size() for t in self._all)

    @property
    def data_ptrs(self) -> list[int]:
        """Where each kept buffer's storage starts (the same from step to step)."""
        return [t.data_ptr() for t in self._all]

    def _fit(self, numel: int) -> torch.Tensor | None:
        fits = [t for t in self._free if t.numel() >= numel]
        return min(fits, key=lambda t: t.numel()) if fits else None

    def full(self, numel: int) -> bool:
        """No free buffer fits ``numel`` and every slot is allocated (the caller
        completes a reduction first)."""
        return self._fit(numel) is None and len(self._all) >= self.slots

    def take(self, numel: int) -> torch.Tensor:
        """A ``(numel,)`` view of a free buffer; a new one when none fits (while slots are
        left, or when the caller could free none)."""
        t = self._fit(numel)
        if t is None:
            t = torch.empty(self.numel or numel, dtype=self.dtype, device=self.device)
            self._all.append(t)
        else:  # by identity (list.remove would compare the tensors' values)
            self._free = [x for x in self._free if x is not t]
        return t[:numel]

    def give(self, view: torch.Tensor) -> None:
        """Return the buffer ``view`` was taken from."""
        for t in self._all:
            if t.data_ptr() == view.data_ptr():
                self._free.append(t)
                return
        raise RuntimeError("ZeRO-2: a gradient buffer returned that the ring did not give")


def plan_buckets(units: list[UnitReduction], nbytes: int, element_size: int) -> list[GradBucket]:
    """Greedy buckets over ``units`` in reverse order (backward order, roughly): a
    bucket closes once it holds at least ``nbytes`` of gradients (as DataParallel's),
    or before a unit reduced over other groups (:attr:`FlatUnit.groups`: expert units)."""
    out: list[GradBucket] = []
    cur: list[UnitReduction] = []
    size = 0
    for r in reversed(units):
        if cur and cur[-1].unit.groups is not r.unit.groups:
            out.append(GradBucket(cur))
            cur, size = [], 0
        cur.append(r)
        size += r.unit.padded * element_size
        if size >= nbytes:
            out.append(GradBucket(cur))
            cur, size = [], 0
    if cur:
        out.append(GradBucket(cur))
    return out


class ParamSync:
    """Stages 1/2 after the step: one all-gather per bucket of the updated shards,
    launched by :meth:`launch`, completed per unit by :meth:`wait`.

    A bucket of one unit is gathered in place: the unit's shard is the input and its
    flat ``(padded,)`` parameters the output (no copy in or out). Otherwise the bucket's
    ``(width,)`` send buffer is its units' shards side by side and the ``(F * width,)``
    output holds row r = rank r's shards, copied into each unit's flat parameters except
    this rank's own chunk. Either way the shard the optimizer wrote must not change while
    a gather is in flight (the optimizer waits first).
    """

    def __init__(
        self,
        shard_group: AxisGroup,
        dtype: torch.dtype,
        device: torch.device,
        note: Callable[[str, str], None],
    ) -> None:
        self.shard_group, self.dtype, self.device, self._note = shard_group, dtype, device, note
        # unit index -> (its bucket, the bucket's (F * width,) output, handle); every
        # unit of a bucket maps to the same entry
        self._pending: dict[int, tuple[GradBucket, torch.Tensor, Any]] = {}

    def _group(self, b: GradBucket) -> AxisGroup:
        """The group ``b``'s units are sharded over (their own, or the wrapper's)."""
        groups = b.units[0].unit.groups
        return groups[0] if groups is not None else self.shard_group

    @property
    def in_flight(self) -> int:
        """Units whose all-gather is launched and not completed."""
        return len(self._pending)

    @torch.no_grad()
    def launch(self, buckets: list[GradBucket]) -> None:
        """Start every bucket's all-gather, in forward order (first unit first)."""
        for b in sorted(buckets, key=lambda b: min(r.unit.index for r in b.units)):
            group = self._group(b)
            if group.size == 1:  # not sharded (an expert unit of a one-rank replica group)
                continue
            if len(b.units) == 1:  # in place: the shard is this rank's chunk of full
                u = b.units[0].unit
                out, h = comm.all_gather(u.full[u.lo : u.hi], group, async_op=True, out=u.full)
            else:  # the units' shards side by side, as the bucket's columns
                send = torch.empty(b.width, dtype=self.dtype, device=self.device)
                for r, col in zip(b.units, b.cols, strict=True):
                    u = r.unit
                    send[col : col + u.shard_numel].copy_(u.full[u.lo : u.hi])
                out, h = comm.all_gather(send, group, async_op=True)  # (F * width,)
            for r in b.units:
                self._pending[r.unit.index] = (b, out, h)
            self._note("gather", b.names)

    @torch.no_grad()
    def wait(self, unit: FlatUnit | None = None) -> None:
        """Complete ``unit``'s bucket's all-gather (every one when None)."""
        todo = list(self._pending) if unit is None else [unit.index]
        for index in todo:
            hit = self._pending.get(index)
            if hit is None:
                continue
            b, out, h = hit
            h.wait()
            group = self._group(b)
            me, f = group.index, group.size
            got = out.view(f, b.width)  # (F, width)
            for r, col in zip(b.units, b.cols, strict=True):
                u = r.unit
                self._pending.pop(u.index, None)
                if out.data_ptr() != u.full.data_ptr():  # not gathered in place
                    full = u.full.view(f, u.shard_numel)
                    part = got[:, col : col + u.shard_numel]
                    full[:me].copy_(part[:me])
                    full[me + 1 :].copy_(part[me + 1 :])
                self._note("gathered", u.name)
