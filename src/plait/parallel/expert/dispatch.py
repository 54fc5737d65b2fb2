"""Expert-parallel dispatch and combine: tokens travel to their experts' ranks and back.

The ``ep`` ranks of a group split the ``E`` routed experts of each MoE layer: rank ``j``
holds experts ``j·E/ep .. (j+1)·E/ep - 1``. A rank's routed rows arrive sorted by
expert (:meth:`plait.model.moe.MoE.route`), so the rows for rank ``j`` are one
contiguous run. :class:`ExpertParallelDispatch` replaces the model's
:class:`~plait.model.moe.LocalDispatch`; per MoE layer and step:

* **dispatch**: an all-to-all of the counts (each rank learns how many rows of each of
  its experts every peer sends: ``(ep, E/ep)``), then an uneven all-to-all of the rows
  themselves (``plait.comm.all_to_all_v``);
* the received rows, ordered by source rank then expert, are regrouped by expert
  (source order kept inside an expert), the local experts run, and the result goes back
  to the source order;
* **combine**: the uneven all-to-all in the other direction;
* backward runs the two row all-to-alls in reverse (:class:`_AllToAllV`).

Every exchange goes through :mod:`plait.comm`, counted on the ``ep`` axis: a rank sends
``(rows to other ranks) · dim · bytes`` on dispatch and ``(rows received from other
ranks) · dim · bytes`` on combine, the same again in backward, plus ``(ep-1)/ep · E · 8``
bytes of counts per layer (:func:`ep_bytes_per_layer`).

The load-balancing loss needs the global assignment counts: :meth:`global_counts` sums
them over the data ranks (dp x cp) with one all-reduce of ``E`` numbers.
"""

from __future__ import annotations

from typing import Any

import torch

from plait import comm
from plait.comm import AxisGroup
from plait.model.moe import Experts, LocalDispatch


class _AllToAllV(torch.autograd.Function):
    """Differentiable uneven all-to-all: backward sends the gradients back."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: AxisGroup, send: list[int], recv: list[int]
    ) -> torch.Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return comm.all_to_all_v(x, group, send, recv)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return comm.all_to_all_v(grad, ctx.group, ctx.recv, ctx.send), None, None, None


def all_to_all_rows(
    x: torch.Tensor, group: AxisGroup, send: list[int], recv: list[int]
) -> torch.Tensor:
    """``x`` ``(sum(send), ...)`` -> ``(sum(recv), ...)`` through :func:`comm.all_to_all_v`,
    differentiable."""
    out: torch.Tensor = _AllToAllV.apply(x, group, send, recv)
    return out


def ep_bytes_per_layer(
    sent: list[int], received: list[int], index: int, row_bytes: int, experts: int, ep: int
) -> float:
    """Bytes one rank sends on the ep axis for one MoE layer in forward + backward:
    ``sent[j]`` rows to rank ``j``, ``received[j]`` rows from it (this rank is ``index``);
    two row all-to-alls each way (dispatch, combine; their backward) and the counts."""
    if ep == 1:
        return 0.0
    away = sum(sent) - sent[index]
    back = sum(received) - received[index]
    return 2.0 * (away + back) * row_bytes + (ep - 1) / ep * experts * 8


class ExpertParallelDispatch(LocalDispatch):
    """Send each row to the rank of its expert, run the local experts, send it back.

    ``ep_group``: the ranks that split the experts (size 1: only the counts are summed);
    ``data_group``: the dp x cp ranks, over which :meth:`global_counts` sums.
    """

    def __init__(self, ep_group: AxisGroup, data_group: AxisGroup, experts: int) -> None:
        super().__init__()
        self.ep_group = ep_group
        self.data_group = data_group
        self.n_experts = experts
        self.last_splits: tuple[list[int], list[int]] = ([], [])
        """(rows sent to, rows received from) each ep rank in the last forward."""
        self.history: list[tuple[list[int], list[int]]] | None = None
        """None (default: nothing kept), or a list a caller sets to collect every
        forward's splits into (traffic checks); it grows until the caller clears it."""

    def global_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``(E,)`` assignments per expert summed over the data ranks (not differentiable)."""
        total = counts.detach().clone()
        comm.all_reduce(total, self.data_group, op="sum")
        return total

    def forward(self, x: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        """``x`` ``(N, dim)`` sorted by expert, ``counts`` ``(E,)`` -> ``(N, dim)``."""
        g, ep = self.ep_group, self.ep_group.size
        local = self.n_experts // ep
        if ep == 1:
            return experts(x, [int(c) for c in counts.tolist()])
        per = counts.to(torch.int64).reshape(ep, local)  # (ep, E/ep) rows for each rank
        got = comm.all_to_all(per.contiguous(), g)  # (ep, E/ep): from each source rank
        assert isinstance(got, torch.Tensor)
        send = [int(v) for v in per.sum(1).tolist()]
        recv = [int(v) for v in got.sum(1).tolist()]  # rows from each source rank
        self.last_splits = (send, recv)
        if self.history is not None:
            self.history.append(self.last_splits)
        rows = all_to_all_rows(x, g, send, recv)  # (M, dim) by source, then expert
        # regroup by expert (source order inside an expert): a permutation of the rows
        r = got.to(torch.int64)  # (ep, E/ep)
        flat = r.reshape(-1)
        start = (torch.cumsum(flat, 0) - flat).reshape(ep, local)  # first row of (j, e)
        seg_start, seg_len = start.t().reshape(-1), r.t().reshape(-1)  # by (e, j)
        seg_off = torch.cumsum(seg_len, 0) - seg_len
        perm = torch.arange(int(flat.sum()), device=x.device) + torch.repeat_interleave(
            (seg_start - seg_off).to(x.device), seg_len.to(x.device)
        )  # (M,) received row of each expert-ordered row
        mine = [int(v) for v in r.sum(0).tolist()]
        y = experts(rows[perm], mine)  # (M, dim) by expert
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel(), device=x.device)
        return all_to_all_rows(y[back], g, recv, send)  # (N, dim) in x's order
