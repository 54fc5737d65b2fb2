"""Expert gradients: reduced only over the ranks that hold the same experts.

Under expert parallelism a rank's expert weights already received, through the
all-to-all's backward, the gradient of every token of its ep group that was routed to
them. The ranks at the same position of every ep block (the *expert replica group*,
``Mesh.expert_axes``) hold the same experts and saw different tokens: the gradient of
the global batch's mean loss is their sum divided by the number of data ranks
(dp x cp), as data parallelism divides its own sum. :class:`ExpertGradSync` does that
at the end of each synchronising backward (one all-reduce of the flattened expert
gradients); inside :meth:`~ExpertGradSync.no_sync` gradients accumulate locally.
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
        missing gradient counts as zeros)."""
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # (total,)
        comm.all_reduce(flat, self.replica, op="sum")
        flat.div_(self.data_ranks)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate expert gradients locally."""
        old = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = old
