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
:class:`~plait.parallel.zero.ZeroDataParallel`: the forward and pre-backward hooks, the
recorded forward order prefetch follows, which units are freed after forward, and the
gathered bytes (now and at peak). It talks to the wrapper only through the callbacks it
is given (a backward pass starts, events).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from plait import comm
from plait.comm import AxisGroup, Handle
from plait.parallel.zero.flat import ROOT, FlatUnit


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
        output (allocated now, filled when the gather completes)."""
        self._go(GatherState.GATHERING)
        shard = self.unit.shard
        assert shard is not None
        src = shard if shard.device == device else shard.to(device)
        self.out, self._handle = comm.all_gather(src, shard_group, async_op=True)
        return self.out

    def finish(self) -> None:
        """Wait for the all-gather; refill ``unit.full`` and point the parameters at it."""
        assert self._handle is not None and self.out is not None
        self._handle.wait()
        self._go(GatherState.GATHERED)
        u = self.unit
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


def _tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensor_leaves(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensor_leaves(o)]
    return []


def _in_autograd() -> bool:
    """Whether the autograd engine is executing (a recomputation inside backward)."""
    return bool(torch._C._current_graph_task_id() != -1)


class ParameterGatherer:
    """The stage-3 parameter path of one ZeRO-wrapped module.

    Args:
        module: the wrapped module (a root unit used only by ``module`` itself stays
            gathered through forward and backward).
        shard_group: the group the parameters are sharded over.
        device: where the full parameters live.
        shard_device: where the persistent shards live (the CPU with offload="params").
        reshard_after_forward: free a unit after its forward.
        prefetch: start the next unit's gather while the current one computes.
        begin_backward: called when a backward pass reaches a unit (the gradient path
            queues its end-of-backward work then).
        note: records an event ``(kind, unit name)`` (tests read the order).
    """

    def __init__(
        self,
        module: nn.Module,
        shard_group: AxisGroup,
        device: torch.device,
        shard_device: torch.device,
        reshard_after_forward: bool,
        prefetch: bool,
        begin_backward: Callable[[], None],
        note: Callable[[str, str], None],
    ) -> None:
        self.module = module
        self.shard_group, self.device, self.shard_device = shard_group, device, shard_device
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self._begin_backward, self._note = begin_backward, note
        self.gathers: list[UnitGather] = []  # by unit index
        self.order: list[FlatUnit] = []  # forward order (recorded at every forward)
        self._order_now: list[FlatUnit] = []
        self._pre_backward_done: set[int] = set()
        # Units freed after their forward and re-gathered for their backward: every
        # wrapped unit, and the root unit when one module (not the root itself) uses it.
        # A root unit used by several modules (tied weights) stays gathered from its first
        # use in forward until its gradients are reduced.
        self.reshardable: set[int] = set()
        self.gathered_bytes = 0  # gathered parameter bytes now, and the peaks
        self.peak_gathered_bytes = 0
        self.peak_gathered_units = 0

    # ------------------------------------------------------------------ set-up

    @torch.no_grad()
    def adopt(self, u: FlatUnit) -> list[RemovableHandle]:
        """Take over ``u`` (its ``full`` holds the initial values, index ``len(gathers)``):
        keep its shard, free the rest, hook its trigger modules; returns the hooks."""
        assert u.index == len(self.gathers)
        u.shard = u.full[u.lo : u.hi].clone().to(self.shard_device)  # (shard_numel,)
        g = UnitGather(u)
        self.gathers.append(g)
        self.order.append(u)
        g.free()  # never counted as gathered
        if u.name != ROOT or (len(u.triggers) == 1 and u.triggers[0] is not self.module):
            self.reshardable.add(u.index)
        hooks = []
        for m in u.triggers:
            hooks.append(m.register_forward_pre_hook(functools.partial(self._pre_forward, u)))
            if u.index in self.reshardable:
                hooks.append(m.register_forward_hook(functools.partial(self._post_forward, u)))
        return hooks

    # ------------------------------------------------------------------ gather / free

    @property
    def live_units(self) -> int:
        """Units gathered or gathering now."""
        return sum(1 for g in self.gathers if g.state is not GatherState.FREE)

    def in_flight(self) -> list[torch.Tensor]:
        """The ``(padded,)`` outputs of the all-gathers in flight (prefetches)."""
        return [g.out for g in self.gathers if g.out is not None]

    def start(self, u: FlatUnit) -> None:
        """Launch the all-gather of ``u``'s shards unless it is gathered or gathering."""
        g = self.gathers[u.index]
        if g.state is not GatherState.FREE:
            return
        out = g.start(self.shard_group, self.device)
        self.gathered_bytes += u.padded * out.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        self.peak_gathered_units = max(self.peak_gathered_units, self.live_units)
        self._note("gather", u.name)

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

    # ------------------------------------------------------------------ forward / backward

    def begin_forward(self) -> None:
        """A forward of the wrapped module starts: record its unit order afresh."""
        self._order_now = []

    def end_forward(self, out: Any) -> None:
        """A forward ended with ``out``: keep the order seen; free everything when no
        backward will follow (no gradient flows from ``out``)."""
        if self._order_now:
            self.order = self._order_now
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in _tensor_leaves(out))):
            self.free_all()

    def after_backward(self) -> None:
        """A synchronising backward ended: free every unit; the next backward gathers again."""
        self._pre_backward_done.clear()
        self.free_all()

    def _pre_forward(self, u: FlatUnit, module: nn.Module, args: Any) -> None:
        if _in_autograd():  # recomputation inside backward: the unit is needed now
            self.ensure(u)
            return
        if all(v is not u for v in self._order_now):
            self._order_now.append(u)
        self.ensure(u)
        if self.prefetch:
            k = next((j for j, v in enumerate(self.order) if v is u), -1)
            if 0 <= k < len(self.order) - 1:
                self.start(self.order[k + 1])

    def _post_forward(self, u: FlatUnit, module: nn.Module, args: Any, output: Any) -> None:
        if _in_autograd():
            return
        if not torch.is_grad_enabled():
            self.free(u)
            return
        if self.reshard_after_forward:
            self.free(u)
        for t in _tensor_leaves(output):
            if t.requires_grad:
                t.register_hook(functools.partial(self._pre_backward, u))

    def _pre_backward(self, u: FlatUnit, grad: torch.Tensor) -> None:
        self._begin_backward()
        if u.index in self._pre_backward_done:
            return
        self._pre_backward_done.add(u.index)
        self.ensure(u)
        if self.prefetch:  # the unit that ran before ``u`` in forward runs next in backward
            k = next((j for j, v in enumerate(self.order) if v is u), -1)
            for v in reversed(self.order[:k] if k > 0 else []):
                if v.index not in self._pre_backward_done and v.index in self.reshardable:
                    self.start(v)  # no-op if it is still gathered
                    break
