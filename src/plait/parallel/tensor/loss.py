"""Vocabulary-parallel cross-entropy (Megatron, Shoeybi et al. 2019, section 3).

The logits of a vocabulary-parallel head are ``(..., Vp/N)`` on each tp rank. The loss is
computed without ever building the full logits: the per-token max and the sum of
exponentials are all-reduced over the tp axis (AllReduce(max), AllReduce(sum)) and the
target logit comes from the rank that owns it. Backward is local: softmax minus one-hot on
this rank's columns. :func:`vocab_parallel_loss` packages it as the ``loss_fn(logits,
targets)`` that ``parallelize`` hands out when tp > 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plait.comm.group import AxisGroup
from plait.comm.ops import all_reduce
from plait.mesh import Mesh

IGNORE_INDEX = -100
"""Default target value that the loss skips (PyTorch's ``ignore_index`` default)."""


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy on vocabulary-sharded logits; saves only the local softmax."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: AxisGroup,
        vocab_size: int,
        ignore_index: int,
        reduction: str,
    ) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        vl = logits.shape[-1]
        z = logits.reshape(-1, vl).to(dtype, copy=True)  # (tokens, Vl) own copy
        t = targets.reshape(-1)  # (tokens,)
        start = group.index * vl
        valid = max(0, min(vl, vocab_size - start))  # columns that are real vocabulary
        if valid < vl:
            z[:, valid:] = float("-inf")  # padded vocabulary never wins
        m = z.max(dim=-1).values  # (tokens,) local max
        all_reduce(m, group, op="max")  # global max: a constant shift, no gradient
        z.sub_(m.unsqueeze(-1))
        keep = t != ignore_index  # (tokens,)
        local_t = t - start
        own = keep & (local_t >= 0) & (local_t < vl)  # the target's logit lives here
        idx = torch.where(own, local_t, torch.zeros_like(local_t))  # (tokens,)
        picked = torch.where(own, z.gather(1, idx.unsqueeze(1)).squeeze(1), 0.0)
        z.exp_()  # (tokens, Vl) exp(z - max)
        stats = torch.stack([picked, z.sum(dim=-1)])  # (2, tokens)
        all_reduce(stats, group, op="sum")  # target logit and sum of exp over the vocab
        per_token = torch.where(keep, stats[1].log() - stats[0], 0.0)  # (tokens,)
        count = keep.sum()
        z.div_(stats[1].unsqueeze(-1))  # (tokens, Vl) local softmax
        ctx.save_for_backward(z, idx, own, keep)
        ctx.shape, ctx.in_dtype, ctx.reduction = logits.shape, logits.dtype, reduction
        if reduction == "sum":
            ctx.scale = 1.0
            return per_token.sum()
        ctx.scale = count.to(dtype)
        return per_token.sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, idx, own, keep = ctx.saved_tensors
        g = softmax.clone()  # (tokens, Vl)
        g.scatter_add_(1, idx.unsqueeze(1), -own.to(g.dtype).unsqueeze(1))  # softmax - onehot
        g.mul_((keep.to(g.dtype) * (grad / ctx.scale)).unsqueeze(1))
        return g.view(ctx.shape).to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: AxisGroup,
    vocab_size: int,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of vocabulary-sharded logits, equal to ``F.cross_entropy`` of the
    full, unpadded logits.

    ``logits`` ``(..., Vp/N)``: this rank's columns of the padded vocabulary (rank ``r``
    holds ``[r·Vp/N, (r+1)·Vp/N)``); ``targets`` ``(...)`` the same on every tp rank.
    Columns at or beyond ``vocab_size`` are padding and are masked out. Targets equal
    to ``ignore_index`` are skipped; ``reduction`` "mean" (over the kept targets) or
    "sum". Computed in at least float32. Communication: two all-reduces over tp of
    ``tokens`` and ``2·tokens`` elements; the full logits are never built.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not match"
        )
    return _VocabParallelCrossEntropy.apply(
        logits, targets, group, vocab_size, ignore_index, reduction
    )


def vocab_parallel_loss(
    mesh: Mesh, vocab_size: int, ignore_index: int = IGNORE_INDEX
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The mean cross-entropy of vocabulary-sharded logits ``(b, s, Vp/N)`` against
    targets ``(b, s)`` over ``mesh``'s tp axis — the value ``F.cross_entropy`` gives on
    the one-device model's full logits (targets equal to ``ignore_index`` skipped)."""
    group = mesh.axis("tp")

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, group, vocab_size, ignore_index)

    return loss
