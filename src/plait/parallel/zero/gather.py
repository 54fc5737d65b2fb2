"""ZeRO stage 3's parameter path: gather a unit's full parameters before use, free after.

Each unit's full parameters are a small state machine, :class:`UnitGather`::

    FREE ──start: all-gather launched──▶ GATHERING ──wait, copy in──▶ GATHERED
      ▲                                      │                            │
      └──── free (waits for the gather) ─────┴─────────── free ───────────┘

Only the ``(shard_numel,)`` shard is persistent. A unit is gathered just before its
forward (the next unit's all-gather is started meanwhile: prefetch), freed after it
(``reshard_after_forward``), gathered again before its backward (triggered by a hook on
its output's gradient) and freed once its gradients are reduce-scattered (Zhao et al.
2023, "PyTorch FSDP").

Gathered storage is freed with ``untyped_storage().resize_(0)``: autograd's saved views of
a parameter keep pointing at the same storage, which is refilled before backward, while
the parameter itself is swapped to an empty tensor so stray reads fail loudly.

:class:`ParameterGatherer` owns the units' gathers for one stage-3
:class:`~plait.parallel.zero.ZeroDataParallel`, behind an interface that names no
driver: start, ensure (wait) and free one unit or all, and the gathered bytes (now and at
peak). When is the driver's to say: the autograd hooks
(:class:`~plait.parallel.zero.driver.AutogradDriver`: before each forward and backward,
with prefetch in the recorded forward order) or the pipeline schedule
(:class:`~plait.parallel.pipeline.zero.PipelineZero`: around its actions). It reports to
its observer only: ``note`` (events).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

from plait import comm
from plait.comm import AxisGroup, Handle
from plait.parallel.zero.flat import FlatUnit


class GatherState(enum.Enum):
    """Where one stage-3 unit's full parameters stand."""

    FREE = "free"
    """Only the shard is held; the parameters are empty tensors."""
    GATHERING = "gathering"
    """The all-gather is in flight (a prefetch)."""
    GATHERED = "gathered"
    """The full parameters are in place."""


_ALLOWED: dict[GatherState, tuple[GatherState, ...]] = {
    GatherState.FREE: (GatherState.GATHERING,),
    GatherState.GATHERING: (GatherState.GATHERED, GatherState.FREE),
    GatherState.GATHERED: (GatherState.FREE,),
}


class UnitGather:
    """One unit's full parameters (see the module docstring for the states).

    Starts GATHERED: at set-up ``unit.full`` holds the initial values.
    """

    def __init__(self, unit: FlatUnit) -> None:
        self.unit = unit
        self.state = GatherState.GATHERED
        # per parameter, an empty tensor of its dtype and rank: what a freed parameter is
        full = unit.full
        self._empty = [
            torch.empty((0,) * p.dim(), dtype=full.dtype, device=full.device) for p in unit.params
        ]
        self.out: torch.Tensor | None = None  # (padded,) the all-gather output in flight
        self._handle: Handle | None = None

    def _go(self, new: GatherState) -> None:
        if new not in _ALLOWED[self.state]:
            raise RuntimeError(
                f"ZeRO unit {self.unit.name!r}: parameters cannot go from "
                f"{self.state.value} to {new.value}"
            )
        self.state = new

    def start(self, shard_group: AxisGroup, device: torch.device) -> torch.Tensor:
        """Launch the all-gather of the shard onto ``device``; returns its ``(padded,)``
        output (allocated now, filled when the gather completes): ``unit.full`` itself,
        refilled in place, when it has the shard's dtype and lives on ``device`` (one
        unit's bytes, not two), else a separate buffer copied in by :meth:`finish`."""
        self._go(GatherState.GATHERING)
        u = self.unit
        shard = u.shard
        assert shard is not None
        # offload="params": the prefetch copies from page-locked host memory (CUDA)
        src = shard if shard.device == device else shard.to(device, non_blocking=shard.is_pinned())
        into = None
        if u.full.dtype == src.dtype and u.full.device == device:
            u.full.untyped_storage().resize_(u.padded * u.full.element_size())
            into = u.full
        self.out, self._handle = comm.all_gather(src, shard_group, async_op=True, out=into)
        return self.out

    def finish(self) -> None:
        """Wait for the all-gather; refill ``unit.full`` (unless gathered into it) and point
        the parameters at it."""
        assert self._handle is not None and self.out is not None
        self._handle.wait()
        self._go(GatherState.GATHERED)
        u = self.unit
        if self.out is not u.full:
            u.full.untyped_storage().resize_(u.padded * u.full.element_size())
            u.full.copy_(self.out)
        self.out, self._handle = None, None
        for i, p in enumerate(u.params):
            p.data = u.view(i, u.full)

    def free(self) -> None:
        """Release the gathered storage (waiting for a gather in flight); the parameters
        become empty tensors."""
        if self.state is GatherState.GATHERING:
            assert self._handle is not None
            self._handle.wait()
            self.out, self._handle = None, None
        self._go(GatherState.FREE)
        self.unit.full.untyped_storage().resize_(0)
        for p, empty in zip(self.unit.params, self._empty, strict=True):
            p.data = empty


class ParameterGatherer:
    """The stage-3 parameter path of one ZeRO-wrapped module.

    Args:
        shard_group: the group the parameters are sharded over (a unit with groups of
            its own, :attr:`FlatUnit.groups`, is gathered over those).
        device: where the full parameters live.
        shard_device: where the persistent shards live (the CPU with offload="params").
        note: records an event ``(kind, unit name)`` (tests read the order).
    """

    def __init__(
        self,
        shard_group: AxisGroup,
        device: torch.device,
        shard_device: torch.device,
        note: Callable[[str, str], None],
    ) -> None:
        self.shard_group, self.device, self.shard_device = shard_group, device, shard_device
        self._note = note
        self.gathers: list[UnitGather] = []  # by unit index
        self.gathered_bytes = 0  # gathered parameter bytes now, and the peaks
        self.peak_gathered_bytes = 0
        self.peak_gathered_units = 0

    # ------------------------------------------------------------------ set-up

    @torch.no_grad()
    def adopt(self, u: FlatUnit, shard: torch.Tensor | None = None) -> None:
        """Take over ``u`` (its ``full`` holds the initial values, index ``len(gathers)``):
        keep its shard, free the rest. ``shard``: the initial shard itself (a meta-built
        model, whose full unit was never allocated)."""
        assert u.index == len(self.gathers)
        if shard is None:
            shard = u.full[u.lo : u.hi].clone()
        u.shard = shard.to(self.shard_device)  # (shard_numel,)
        if self.shard_device.type == "cpu" and self.device.type == "cuda":
            u.shard = u.shard.pin_memory()  # offload="params": asynchronous prefetch
        g = UnitGather(u)
        self.gathers.append(g)
        g.free()  # never counted as gathered

    # ------------------------------------------------------------------ gather / free

    @property
    def live_units(self) -> int:
        """Units gathered or gathering now."""
        return sum(1 for g in self.gathers if g.state is not GatherState.FREE)

    def in_flight(self) -> list[torch.Tensor]:
        """The ``(padded,)`` outputs of the all-gathers in flight (prefetches)."""
        return [g.out for g in self.gathers if g.out is not None]

    def start(self, u: FlatUnit) -> bool:
        """Launch the all-gather of ``u``'s shards unless it is gathered or gathering;
        returns whether it was launched."""
        g = self.gathers[u.index]
        if g.state is not GatherState.FREE:
            return False
        group = u.groups[0] if u.groups is not None else self.shard_group  # expert units: own
        out = g.start(group, self.device)
        self.gathered_bytes += u.padded * out.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        self.peak_gathered_units = max(self.peak_gathered_units, self.live_units)
        self._note("gather", u.name)
        return True

    def ensure(self, u: FlatUnit) -> None:
        """Block until ``u``'s full parameters are in place (gathering if needed)."""
        g = self.gathers[u.index]
        if g.state is GatherState.GATHERED:
            return
        self.start(u)
        g.finish()

    def gather_all(self) -> None:
        """Hold every unit's full parameters."""
        for g in self.gathers:
            self.ensure(g.unit)

    def free(self, u: FlatUnit) -> None:
        """Release ``u``'s gathered storage (no-op if it is free)."""
        g = self.gathers[u.index]
        if g.state is GatherState.FREE:
            return
        g.free()
        self.gathered_bytes -= u.padded * u.full.element_size()
        self._note("free", u.name)

    def free_all(self) -> None:
        """Release every unit."""
        for g in self.gathers:
            self.free(g.unit)

    def reset_peaks(self) -> None:
        """Restart the peak counters from what is gathered now."""
        self.peak_gathered_bytes = self.gathered_bytes
        self.peak_gathered_units = self.live_units
