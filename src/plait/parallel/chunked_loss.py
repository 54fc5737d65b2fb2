"""Chunked cross-entropy: the full-vocabulary float32 logits are never built at once.

Two autograd functions, each equal to ``F.cross_entropy`` on the full logits (values and
gradients) while holding at most one chunk of ``chunk`` tokens x the (local) vocabulary
in float32:

* :func:`chunked_cross_entropy` takes logits in any dtype (bf16 on a GPU). Forward walks
  the tokens chunk by chunk and keeps only each token's log-sum-exp and target logit;
  the logits themselves are saved by reference (no float32 copy, no saved softmax).
  Backward recomputes ``softmax - onehot`` chunk by chunk into a gradient of the logits'
  dtype. With ``group`` (the tp axis) the logits are this rank's vocabulary columns and
  the per-token statistics are combined over the group with the same two all-reduces as
  :func:`~plait.parallel.tensor.loss.vocab_parallel_cross_entropy` (``tokens`` and
  ``2·tokens`` elements).
* :func:`linear_cross_entropy` fuses the output projection: it takes the hidden states
  ``(tokens, dim)`` and the head's weight ``(V, dim)`` and never holds the logits, not
  even in 16 bits; backward recomputes each chunk's logits and accumulates the weight's
  gradient chunk by chunk (Liger-kernel style). It pays where the logits dominate
  memory (a large vocabulary, many tokens per rank) and is offered to user loops.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.comm.group import AxisGroup
from plait.comm.ops import all_reduce

IGNORE_INDEX = -100
"""Target value the loss skips (PyTorch's ``ignore_index`` default)."""


def _spans(n: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, end)`` token ranges of at most ``chunk`` tokens (0: one range)."""
    step = chunk if chunk > 0 else max(n, 1)
    return [(s, min(s + step, n)) for s in range(0, n, step)]


def _combine(
    lse: torch.Tensor, picked: torch.Tensor, group: AxisGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token global log-sum-exp and target logit from this rank's ``lse``/``picked``
    ``(tokens,)``: two all-reduces over ``group`` (max of ``tokens``, sum of
    ``2·tokens`` elements), none without a group."""
    if group is None:
        return lse, picked
    m = lse.clone()
    all_reduce(m, group, op="max")  # (tokens,) a constant shift
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    stats = torch.stack([picked, (lse - m).exp()])  # (2, tokens)
    all_reduce(stats, group, op="sum")  # target logit (owned by one rank), sum of exp
    return m + stats[1].log(), stats[0]


def _targets(
    t: torch.Tensor, start: int, width: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``keep`` (not ignored), ``own`` (target column on this rank) and the local column
    ``idx`` (0 where not owned), each ``(tokens,)``."""
    keep = t != ignore_index
    local = t - start
    own = keep & (local >= 0) & (local < width)
    idx = torch.where(own, local, torch.zeros_like(local))
    return keep, own, idx


def _reduce(per_token: torch.Tensor, keep: torch.Tensor, reduction: str) -> tuple[Any, Any]:
    """The loss and the divisor its gradient is scaled by."""
    if reduction == "sum":
        return per_token.sum(), 1.0
    count = keep.sum().to(per_token.dtype)
    return per_token.sum() / count, count


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Cross-entropy of (vocabulary-sharded) logits, chunked over tokens."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: AxisGroup | None,
        vocab_size: int,
        ignore_index: int,
        reduction: str,
        chunk: int,
    ) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        vl = logits.shape[-1]
        z = logits.reshape(-1, vl)  # (tokens, Vl), not copied
        start = group.index * vl if group is not None else 0
        valid = max(0, min(vl, vocab_size - start))  # real vocabulary columns here
        keep, own, idx = _targets(targets.reshape(-1), start, vl, ignore_index)
        n = z.shape[0]
        lse = torch.full((n,), float("-inf"), dtype=dtype, device=z.device)
        picked = torch.zeros(n, dtype=dtype, device=z.device)
        for s, e in _spans(n, chunk):
            zc = z[s:e, :valid].to(dtype)  # (chunk, valid) the only float32 block
            lse[s:e] = torch.logsumexp(zc, dim=-1) if valid else lse[s:e]
            if valid:
                got = zc.gather(1, idx[s:e].clamp(max=valid - 1).unsqueeze(1)).squeeze(1)
                picked[s:e] = torch.where(own[s:e], got, 0.0)
        lse, picked = _combine(lse, picked, group)
        per_token = torch.where(keep, lse - picked, 0.0)  # (tokens,)
        loss, scale = _reduce(per_token, keep, reduction)
        ctx.save_for_backward(logits, lse, idx, own, keep)
        ctx.valid, ctx.chunk, ctx.scale = valid, chunk, scale
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, lse, idx, own, keep = ctx.saved_tensors
        vl, valid = logits.shape[-1], ctx.valid
        z = logits.reshape(-1, vl)
        out = torch.zeros_like(z)  # (tokens, Vl) in the logits' dtype; padding stays 0
        weight = keep.to(lse.dtype) * (grad.to(lse.dtype) / ctx.scale)  # (tokens,)
        in_place = out.dtype == lse.dtype  # float32 logits: work in the gradient itself
        for s, e in _spans(z.shape[0], ctx.chunk):
            if not valid:
                break
            dst = out[s:e, :valid]  # (chunk, valid)
            g = dst if in_place else torch.empty_like(dst, dtype=lse.dtype)  # the one block
            torch.sub(z[s:e, :valid], lse[s:e, None], out=g).exp_()  # softmax
            g.scatter_add_(1, idx[s:e, None], -own[s:e, None].to(g.dtype))  # - onehot
            g.mul_(weight[s:e, None])
            if not in_place:
                dst.copy_(g)
            del g
        return out.view(logits.shape), None, None, None, None, None, None


def chunked_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = 0,
    *,
    group: AxisGroup | None = None,
    vocab_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(logits.reshape(-1, V).float(), targets.reshape(-1))`` computed
    ``chunk`` tokens at a time (0: all at once), in at least float32.

    ``logits`` ``(..., V)`` any float dtype, ``targets`` ``(...)``. With ``group`` the
    logits are this rank's columns ``[r·Vl, (r+1)·Vl)`` of a vocabulary padded to a
    multiple of the group size; columns at or beyond ``vocab_size`` are padding.
    Memory beyond the logits and their gradient: one ``(chunk, Vl)`` float32 block and
    a few ``(tokens,)`` vectors.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not match"
        )
    if chunk < 0:
        raise ValueError(f"chunk must be >= 0 tokens, got {chunk}")
    vocab = (
        vocab_size if vocab_size is not None else logits.shape[-1] * (group.size if group else 1)
    )
    return _ChunkedCrossEntropy.apply(logits, targets, group, vocab, ignore_index, reduction, chunk)


class _LinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(hidden @ weight.T, targets)`` without holding the logits."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        chunk: int,
    ) -> torch.Tensor:
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        h = hidden.reshape(-1, hidden.shape[-1])  # (tokens, dim)
        keep, own, idx = _targets(targets.reshape(-1), 0, weight.shape[0], ignore_index)
        n = h.shape[0]
        lse = torch.empty(n, dtype=dtype, device=h.device)
        picked = torch.empty(n, dtype=dtype, device=h.device)
        for s, e in _spans(n, chunk):
            zc = (h[s:e] @ weight.t()).to(dtype)  # (chunk, V)
            lse[s:e] = torch.logsumexp(zc, dim=-1)
            picked[s:e] = zc.gather(1, idx[s:e, None]).squeeze(1)
        per_token = torch.where(keep, lse - picked, 0.0)
        loss, scale = _reduce(per_token, keep, "mean")
        ctx.save_for_backward(hidden, weight, lse, idx, own, keep)
        ctx.chunk, ctx.scale = chunk, scale
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, lse, idx, own, keep = ctx.saved_tensors
        h = hidden.reshape(-1, hidden.shape[-1])
        gh = torch.empty_like(h)  # (tokens, dim)
        gw = torch.zeros_like(weight, dtype=lse.dtype)  # (V, dim) accumulated in fp32
        weight_scale = keep.to(lse.dtype) * (grad.to(lse.dtype) / ctx.scale)
        for s, e in _spans(h.shape[0], ctx.chunk):
            g = (h[s:e] @ weight.t()).to(lse.dtype)  # (chunk, V) logits again
            g.sub_(lse[s:e, None]).exp_()  # softmax
            g.scatter_add_(1, idx[s:e, None], -own[s:e, None].to(g.dtype))
            gc = g.mul_(weight_scale[s:e, None]).to(h.dtype)
            gh[s:e] = gc @ weight  # (chunk, dim)
            gw.addmm_(gc.t().to(gw.dtype), h[s:e].to(gw.dtype))  # (V, dim)
        return gh.view(hidden.shape), gw.to(weight.dtype), None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = 1024,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean ``F.cross_entropy(hidden @ weight.T, targets)`` fused with the output
    projection, ``chunk`` tokens at a time (0: all at once).

    ``hidden`` ``(..., dim)``, ``weight`` ``(V, dim)`` (a replicated head), ``targets``
    ``(...)``. The logits exist one ``(chunk, V)`` block at a time, in float32; backward
    recomputes them (one extra head matmul per chunk) and returns the gradients of
    ``hidden`` and ``weight``.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} do not match"
        )
    if chunk < 0:
        raise ValueError(f"chunk must be >= 0 tokens, got {chunk}")
    return _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, chunk)
