"""One unit's gradient reduction: the state machine from its first gradient to its shard.

Each flat unit's reduction (reduce-scatter as backward produces the gradients) is a
small state machine, :class:`UnitReduction`::

           first gradient                all gradients (or end of backward)
    IDLE ─────────────────▶ COLLECTING ───────────────────────────────▶ SCATTERING
     ▲ ▲                                                                    │
     │ │                                             reduce-scatter waited  │
     │ └── stages 2/3: shard added into grad_shard ── REPLICATING ◀─────────┘
     │                                                    │  hybrid all-reduce
     └──────── zero_grad (reset) ─────── REDUCED ◀────────┘  waited; stages 0/1

REPLICATING is passed through at once without hybrid sharding (one replica). A unit with
no gradient at the end of backward (``find_unused_parameters``) goes from IDLE straight to
SCATTERING; stages 0/1 may start the next backward from REDUCED (no ``zero_grad`` between).

The coordinator of every unit's reduction, the in-flight cap and the refusal of
parameters with no gradient: :class:`~plait.parallel.zero.reducer.GradientReducer`.
"""

from __future__ import annotations

import enum

import torch

from plait import comm
from plait.comm import AxisGroup, Handle
from plait.parallel.zero.flat import FlatUnit


class ReduceState(enum.Enum):
    """Where one unit's gradient reduction stands in the current backward pass."""

    IDLE = "idle"
    """No gradient of this backward has arrived (or the reduced shard was consumed)."""
    COLLECTING = "collecting"
    """Some of the unit's parameters have their gradients; waiting for the rest."""
    SCATTERING = "scattering"
    """The reduce-scatter of the unit's flat gradient is in flight."""
    REPLICATING = "replicating"
    """Reduce-scatter done; the hybrid all-reduce across replicas is in flight (or none)."""
    REDUCED = "reduced"
    """Stages 0/1: the averaged shard is ready for the optimizer."""


_ALLOWED: dict[ReduceState, tuple[ReduceState, ...]] = {
    ReduceState.IDLE: (ReduceState.IDLE, ReduceState.COLLECTING, ReduceState.SCATTERING),
    ReduceState.COLLECTING: (ReduceState.SCATTERING, ReduceState.IDLE),
    ReduceState.SCATTERING: (ReduceState.REPLICATING,),
    ReduceState.REPLICATING: (ReduceState.REDUCED, ReduceState.IDLE),
    ReduceState.REDUCED: (ReduceState.IDLE, ReduceState.COLLECTING, ReduceState.SCATTERING),
}
"""The legal moves; anything else is a bug in the caller and raises."""


class UnitReduction:
    """One unit's gradient reduction (see the module docstring for the states)."""

    def __init__(self, unit: FlatUnit) -> None:
        self.unit = unit
        self.state = ReduceState.IDLE
        self.ready: set[int] = set()  # indices of the unit's parameters with a gradient
        self.shard: torch.Tensor | None = None  # (shard_numel,) the reduce-scatter output
        self._scatter: Handle | None = None
        self._buffer: torch.Tensor | None = None  # (padded,) kept alive while in flight
        self._replicate: Handle | None = None

    def _go(self, new: ReduceState) -> None:
        if new not in _ALLOWED[self.state]:
            raise RuntimeError(
                f"ZeRO unit {self.unit.name!r}: gradient reduction cannot go from "
                f"{self.state.value} to {new.value}"
            )
        self.state = new

    @property
    def complete(self) -> bool:
        """Every parameter of the unit has its gradient."""
        return len(self.ready) == len(self.unit.params)

    def mark_ready(self, i: int) -> bool:
        """Parameter ``i``'s gradient arrived; returns whether it was the unit's first."""
        first = self.state is not ReduceState.COLLECTING
        if first:  # from IDLE or REDUCED; a gradient during a reduction is an error
            self._go(ReduceState.COLLECTING)
        self.ready.add(i)
        return first

    def launch(self, buffer: torch.Tensor, shard_group: AxisGroup) -> None:
        """Start the reduce-scatter (average) of the flat ``(padded,)`` ``buffer``."""
        self._go(ReduceState.SCATTERING)
        out, h = comm.reduce_scatter(buffer, shard_group, op="avg", async_op=True)
        self.shard, self._scatter, self._buffer = out, h, buffer

    def joined(self, shard: torch.Tensor, handle: Handle, buffer: torch.Tensor) -> None:
        """The unit's gradient goes out in a bucket's reduce-scatter (``handle``); its
        averaged ``(shard_numel,)`` piece will be ``shard``, a view into the output."""
        self._go(ReduceState.SCATTERING)
        self.shard, self._scatter, self._buffer = shard, handle, buffer

    def finish_scatter(self, replicate_group: AxisGroup) -> None:
        """Wait for the reduce-scatter; start the all-reduce across replicas (hybrid)."""
        assert self._scatter is not None
        self._scatter.wait()
        self._go(ReduceState.REPLICATING)
        self._scatter, self._buffer = None, None
        if replicate_group.size > 1:
            assert self.shard is not None
            self._replicate = comm.all_reduce(self.shard, replicate_group, op="avg", async_op=True)

    def finish(self, keep: bool) -> torch.Tensor:
        """Wait for the replicas' all-reduce; return the averaged ``(shard_numel,)`` shard.
        ``keep`` (stages 0/1) holds it as REDUCED; otherwise the unit returns to IDLE."""
        if self._replicate is not None:
            self._replicate.wait()
            self._replicate = None
        out = self.shard
        assert out is not None
        if self.unit.grad_scale != 1.0:  # expert units: replica ranks / data ranks
            out.mul_(self.unit.grad_scale)
        self.ready.clear()
        self._go(ReduceState.REDUCED if keep else ReduceState.IDLE)
        if not keep:
            self.shard = None
        return out

    @property
    def in_flight(self) -> bool:
        """A reduce-scatter or the replicas' all-reduce has been launched and not finished."""
        return self.state in (ReduceState.SCATTERING, ReduceState.REPLICATING)

    def reset(self) -> None:
        """Drop the collected gradients or the reduced shard (the optimizer consumed it):
        back to IDLE. Refused while a reduction is in flight."""
        if self.in_flight:
            raise RuntimeError(
                f"ZeRO unit {self.unit.name!r}: reset while a reduction is in flight "
                f"({self.state.value})"
            )
        self._go(ReduceState.IDLE)
        self.shard = None
        self.ready.clear()
