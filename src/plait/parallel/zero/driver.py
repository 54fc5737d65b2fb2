"""The autograd driver: one of the two drivers of the ZeRO drive interface (hooks).

A :class:`~plait.parallel.zero.ZeroDataParallel` hands its driver-neutral state machines
as one :class:`~plait.parallel.zero.drive.ZeroDrive`: the gradient reductions
(:class:`~plait.parallel.zero.reducer.GradientReducer`) and, at stage 3, the parameter
gathers (:class:`~plait.parallel.zero.gather.ParameterGatherer`). Exactly one driver,
chosen when the wrapper is built, says when each moves. :class:`AutogradDriver`, the
default (``driver="autograd"``), reacts to autograd:

* a post-accumulate-grad hook on every flattened parameter hands its gradient to the
  reducer (which reduce-scatters a unit once all of its are in); the first one of a
  reducing backward queues, on the autograd engine, the end-of-backward work: the
  reducer finishes (or refuses parameters with no gradient) and stage 3 frees every unit;
* stage 3: a forward pre-hook on each unit's modules gathers the unit (and, with
  ``prefetch``, starts the next one's gather in the recorded forward order), a forward
  hook frees it (``reshard_after_forward``) and hooks its output's gradient, which
  gathers it again before its backward (prefetching the unit that ran before it); the
  reducer's ``on_launch`` frees a unit once its reduce-scatter is launched.

The other driver of the same interface is the pipeline schedule
(``driver="schedule"``: :class:`~plait.parallel.pipeline.zero.PipelineZero`); a wrapper
built for it never builds this one, so no hook is installed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.parallel.zero.drive import ZeroDrive
from plait.parallel.zero.flat import ROOT, FlatUnit


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


class AutogradDriver:
    """Drive ``drive``'s reducer and (stage 3) gatherer from autograd hooks.

    Args:
        module: the wrapped module (a root unit used only by ``module`` itself stays
            gathered through forward and backward).
        drive: the wrapper's units, reducer and gatherer (None below stage 3).
        reshard_after_forward: stage 3: free a unit after its forward.
        prefetch: stage 3: start the next unit's gather while the current one computes.
        note: records an event ``(kind, unit name)`` (tests read the order).
    """

    def __init__(
        self,
        module: nn.Module,
        drive: ZeroDrive,
        reshard_after_forward: bool,
        prefetch: bool,
        note: Callable[[str, str], None],
    ) -> None:
        units, reducer, gatherer = drive.units, drive.reducer, drive.gatherer
        self.module, self.reducer, self.gatherer = module, reducer, gatherer
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self._note = note
        self.order: list[FlatUnit] = list(units)  # stage 3: forward order (every forward)
        self._order_now: list[FlatUnit] = []
        self._pre_backward_done: set[int] = set()
        # Stage 3: units freed after their forward and re-gathered for their backward:
        # every wrapped unit, and the root unit when one module (not the root itself) uses
        # it. A root unit used by several modules (tied weights) stays gathered from its
        # first use in forward until its gradients are reduced.
        self.reshardable: set[int] = set()
        if gatherer is not None:
            reducer.on_launch = gatherer.free  # a reduce-scatter launched: free the unit
            for u in units:
                self._hook_unit(u)
        for u in units:
            for i, p in enumerate(u.params):
                hook = functools.partial(self._on_grad, u, i)
                p.register_post_accumulate_grad_hook(hook)

    def _hook_unit(self, u: FlatUnit) -> None:
        """Stage 3: hook ``u``'s trigger modules (gather before, free after forward)."""
        if u.name != ROOT or (len(u.triggers) == 1 and u.triggers[0] is not self.module):
            self.reshardable.add(u.index)
        for m in u.triggers:
            pre = functools.partial(self._pre_forward, u)
            m.register_forward_pre_hook(pre)
            if u.index in self.reshardable:
                post = functools.partial(self._post_forward, u)
                m.register_forward_hook(post)

    # ------------------------------------------------------------------ gradients

    def begin_backward(self) -> None:
        """A reducing backward reaches the module: queue its end on the autograd engine."""
        if self.reducer.begin_backward():
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, u: FlatUnit, i: int, p: torch.Tensor) -> None:
        if self.reducer.communicates:  # stages 0/1 under no_sync accumulate locally
            self.begin_backward()
        self.reducer.on_grad(u, i, p)

    def _end_backward(self) -> None:
        """End of a reducing backward: finish the reductions (or refuse parameters with
        no gradient); stage 3 frees every unit, the next backward gathers again."""
        try:
            self.reducer.finish_backward()
        finally:
            if self.gatherer is not None:
                self._pre_backward_done.clear()
                self.gatherer.free_all()
        self._note("synced", "")

    # ------------------------------------------------------------------ stage 3

    def begin_forward(self) -> None:
        """A forward of the wrapped module starts: record its unit order afresh."""
        self._order_now = []

    def end_forward(self, out: Any) -> None:
        """A forward ended with ``out``: keep the order seen; stage 3 frees everything when
        no backward will follow (no gradient flows from ``out``)."""
        if self._order_now:
            self.order = self._order_now
        if self.gatherer is None:
            return
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in _tensor_leaves(out))):
            self.gatherer.free_all()

    def _pre_forward(self, u: FlatUnit, module: nn.Module, args: Any) -> None:
        g = self.gatherer
        assert g is not None
        if _in_autograd():  # recomputation inside backward: the unit is needed now
            g.ensure(u)
            return
        if all(v is not u for v in self._order_now):
            self._order_now.append(u)
        g.ensure(u)
        if self.prefetch:
            k = next((j for j, v in enumerate(self.order) if v is u), -1)
            if 0 <= k < len(self.order) - 1:
                g.start(self.order[k + 1])

    def _post_forward(self, u: FlatUnit, module: nn.Module, args: Any, output: Any) -> None:
        g = self.gatherer
        assert g is not None
        if _in_autograd():
            return
        if not torch.is_grad_enabled():
            g.free(u)
            return
        if self.reshard_after_forward:
            g.free(u)
        for t in _tensor_leaves(output):
            if t.requires_grad:
                t.register_hook(functools.partial(self._pre_backward, u))

    def _pre_backward(self, u: FlatUnit, grad: torch.Tensor) -> None:
        g = self.gatherer
        assert g is not None
        self.begin_backward()
        if u.index in self._pre_backward_done:
            return
        self._pre_backward_done.add(u.index)
        g.ensure(u)
        if self.prefetch:  # the unit that ran before ``u`` in forward runs next in backward
            k = next((j for j, v in enumerate(self.order) if v is u), -1)
            for v in reversed(self.order[:k] if k > 0 else []):
                if v.index not in self._pre_backward_done and v.index in self.reshardable:
                    g.start(v)  # no-op if it is still gathered
                    break
