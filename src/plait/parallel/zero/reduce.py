"""ZeRO's gradient path: per-unit reduce-scatter as backward produces the gradients.

:class:`GradientReduction` is the part of :class:`plait.parallel.zero.ZeroDataParallel`
that runs inside backward. A post-accumulate-grad hook on every flattened parameter
notes that its gradient is ready; when every parameter of a unit has one, the unit's
flat ``(padded,)`` gradient is reduce-scattered asynchronously over the shard group
(ReduceScatter, Rajbhandari et al. 2020), the average landing in this rank's
``(shard_numel,)`` piece. With hybrid sharding the piece is then all-reduced over the
replicate group (AllReduce). Stages 0/1 keep full gradient buffers (``.grad`` is a view
into them) and communicate only in the synchronising backward (``no_sync``
accumulates locally); stages 2/3 copy the gradients into a transient buffer, reduce on
every backward and keep only the shard. A callback queued on the autograd engine
finishes the reductions at the end of backward and refuses parameters that got no
gradient (unless ``find_unused_parameters``).

The mixin holds no state of its own: every attribute is created by
``ZeroDataParallel.__init__`` (declared below for the type checker).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from plait import comm
from plait.comm import Handle
from plait.parallel.data import UnusedParametersError
from plait.parallel.zero.flat import FlatUnit


class GradientReduction:
    """Backward-time gradient reduction of :class:`~plait.parallel.zero.ZeroDataParallel`."""

    MAX_REDUCES_IN_FLIGHT = 2
    """Reduce-scatters allowed in flight before the oldest is completed (stages 2/3 free
    its full gradient buffer then)."""

    if TYPE_CHECKING:
        stage: int
        units: list[FlatUnit]
        device: torch.device
        reduce_dtype: torch.dtype
        shard_group: comm.AxisGroup
        replicate_group: comm.AxisGroup
        find_unused_parameters: bool
        record_events: bool
        events: list[tuple[str, str]]
        grad_buffer_bytes: int
        peak_grad_buffer_bytes: int
        _where: dict[nn.Parameter, tuple[FlatUnit, int]]
        _sync: bool
        _in_backward: bool
        _ready: dict[int, set[int]]
        _launched: list[FlatUnit]
        _pending_reduce: dict[int, tuple[torch.Tensor, Handle, torch.Tensor]]
        _pending_allreduce: dict[int, tuple[torch.Tensor, Handle | None]]
        _reduced: dict[int, torch.Tensor]
        _pre_backward_done: set[int]

        def _note(self, kind: str, u: FlatUnit) -> None: ...
        def _free(self, u: FlatUnit, count: bool = True) -> None: ...
        def _free_all(self) -> None: ...

    def _begin_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            if self.record_events:
                self.events.append(("backward", ""))
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_grad(self, p: torch.Tensor) -> None:
        u, i = self._where[p]  # type: ignore[index]
        assert p.grad is not None
        if self.stage <= 1:
            if not self._sync:
                return
            self._begin_backward()
            assert u.grad_full is not None
            view = u.view(i, u.grad_full)
            if p.grad.data_ptr() != view.data_ptr():  # .grad was replaced: adopt its value
                view.copy_(p.grad)
                p.grad = view
        else:
            self._begin_backward()
            if u.grad_full is None:
                self._alloc_grad_buffer(u)
            assert u.grad_full is not None
            u.view(i, u.grad_full).copy_(p.grad)
            p.grad = None
        if not self._ready[u.index] and self.record_events:
            self.events.append(("grad", u.name))  # the unit's first gradient arrived
        self._ready[u.index].add(i)
        if len(self._ready[u.index]) == len(u.params):
            self._launch_reduce(u)

    def _alloc_grad_buffer(self, u: FlatUnit) -> None:
        """Stages 2/3: a transient ``(padded,)`` buffer for ``u``'s full gradients."""
        u.grad_full = torch.zeros(u.padded, dtype=self.reduce_dtype, device=self.device)
        self.grad_buffer_bytes += u.grad_full.numel() * u.grad_full.element_size()
        self.peak_grad_buffer_bytes = max(self.peak_grad_buffer_bytes, self.grad_buffer_bytes)

    def _launch_reduce(self, u: FlatUnit) -> None:
        """Reduce-scatter ``u``'s gradients asynchronously; stage 3 then frees ``u``.

        At most ``MAX_REDUCES_IN_FLIGHT`` reduce-scatters are in flight: launching one
        more completes the oldest, which (stages 2/3) frees its full-size gradient buffer,
        so the transient gradient memory stays a few units, not the whole model.
        """
        assert u.grad_full is not None
        buf = u.grad_full.to(self.reduce_dtype)  # (padded,) a copy only if dtypes differ
        out, h = comm.reduce_scatter(buf, self.shard_group, op="avg", async_op=True)
        self._pending_reduce[u.index] = (out, h, buf)
        self._launched.append(u)
        self._note("reduce", u)
        if self.stage == 3:
            self._free(u)
        in_flight = [v for v in self._launched if v.index in self._pending_reduce]
        for v in in_flight[: max(0, len(in_flight) - self.MAX_REDUCES_IN_FLIGHT)]:
            self._complete_reduce(v)

    def _complete_reduce(self, u: FlatUnit) -> None:
        """Wait for ``u``'s reduce-scatter, start the all-reduce across replicas (hybrid)
        and, for stages 2/3, drop the full-size gradient buffer."""
        out, h, _ = self._pending_reduce.pop(u.index)
        h.wait()
        h2 = None
        if self.replicate_group.size > 1:
            h2 = comm.all_reduce(out, self.replicate_group, op="avg", async_op=True)
        self._pending_allreduce[u.index] = (out, h2)
        if self.stage >= 2 and u.grad_full is not None:
            self.grad_buffer_bytes -= u.grad_full.numel() * u.grad_full.element_size()
            u.grad_full = None

    def _finish_backward(self) -> None:
        """End of a synchronising backward: reduce what is left, wait, keep the shards."""
        self._in_backward = False
        launched = {u.index for u in self._launched}
        for u in self.units:
            if u.index in launched:
                continue
            missing = [u.names[i] for i in range(len(u.params)) if i not in self._ready[u.index]]
            if missing and not self.find_unused_parameters:
                self._abandon_backward()
                raise UnusedParametersError(
                    f"{len(missing)} parameter(s) received no gradient in this backward pass: "
                    f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}. Every "
                    "rank must reduce the same units: pass find_unused_parameters=True to "
                    "reduce zeros for them, or set requires_grad=False on them."
                )
            if u.grad_full is None:
                self._alloc_grad_buffer(u)
            self._launch_reduce(u)
        for u in self._launched:
            if u.index in self._pending_reduce:
                self._complete_reduce(u)
        for u in self._launched:
            out, h2 = self._pending_allreduce.pop(u.index)
            if h2 is not None:
                h2.wait()
            if self.stage >= 2:
                assert u.grad_shard is not None
                u.grad_shard.add_(out)
            else:
                self._reduced[u.index] = out
            self._ready[u.index].clear()
        self._launched = []
        self._pre_backward_done.clear()
        if self.stage == 3:
            self._free_all()
        if self.record_events:
            self.events.append(("synced", ""))

    def _abandon_backward(self) -> None:
        for u in self._launched:
            if u.index in self._pending_reduce:
                self._complete_reduce(u)
            h2 = self._pending_allreduce.pop(u.index)[1]
            if h2 is not None:
                h2.wait()
        self._launched = []
        for s in self._ready.values():
            s.clear()
        for u in self.units:
            if self.stage >= 2 and u.grad_full is not None:
                self.grad_buffer_bytes -= u.grad_full.numel() * u.grad_full.element_size()
                u.grad_full = None
        self._pre_backward_done.clear()
        if self.stage == 3:
            self._free_all()
