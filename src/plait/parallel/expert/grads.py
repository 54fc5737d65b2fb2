"""Expert gradients: reduced only over the ranks that hold the same experts.

Under expert parallelism a rank's expert weights already received, through the
all-to-all's backward, the gradient of every token of its ep group that was routed to
them. The ranks at the same position of every ep block (the *expert replica group*,
``Mesh.expert_axes``) hold the same experts and saw different tokens: the gradient of
the global batch's mean loss is their sum divided by the number of data ranks
(dp x cp), as data parallelism divides its own sum. :class:`ExpertGradSync` does that
at the end of each synchronising backward (one all-reduce of the flattened expert
gradients, in a buffer kept across steps); inside :meth:`~ExpertGradSync.no_sync`
gradients accumulate locally.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from plait import comm
from plait.comm import AxisGroup


class ExpertGradSync:
    """Sum ``params``' gradients over ``replica`` and divide by ``data_ranks``.

    ``syncing`` (default: always) tells whether the data-parallel wrapper reduces in
    this backward (False inside its ``no_sync``, which the pipeline schedule and
    gradient accumulation use); the expert gradients follow it.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        replica: AxisGroup,
        data_ranks: int,
        syncing: Callable[[], bool] | None = None,
    ) -> None:
        self.params = params
        self.replica = replica
        self.data_ranks = data_ranks
        self._syncing = syncing
        self._sync = True
        self._queued = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        if len({(p.dtype, p.device) for p in params}) > 1:
            raise ValueError("ExpertGradSync: the expert weights differ in dtype or device")
        self.buffer: torch.Tensor | None = None
        """``(total,)`` the flattened expert gradients the all-reduce runs on, kept across
        steps (as data parallelism's buckets; the memory report counts it)."""

    def _on_grad(self, p: torch.Tensor) -> None:
        wrapper = self._syncing() if self._syncing is not None else True
        if self._sync and wrapper and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    @torch.no_grad()
    def _finish(self) -> None:
        """End of a synchronising backward: one all-reduce of every expert gradient."""
        self._queued = False
        self.reduce()

    @torch.no_grad()
    def reduce(self) -> None:
        """Sum the gradients over the replica group and divide by the data ranks (a
        missing gradient counts as zeros), in :attr:`buffer`: each ``.grad`` becomes a
        view into it."""
        if not self.params:
            return
        buf = self.buffer
        if buf is None:
            total = sum(p.numel() for p in self.params)
            p0 = self.params[0]
            buf = self.buffer = torch.empty(total, dtype=p0.dtype, device=p0.device)
        offset = 0
        for p in self.params:
            view = buf[offset : offset + p.numel()].view_as(p)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
            offset += p.numel()
        comm.all_reduce(buf, self.replica, op="sum")
        buf.div_(self.data_ranks)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate expert gradients locally."""
        old = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = old
