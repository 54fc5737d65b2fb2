"""Exact attention computed block by block with an online softmax (FlashAttention).

Scores ``S = scale · Q Kᵀ`` are never materialised for the whole sequence: the queries
are cut into blocks (outer loop, FlashAttention-2 order) and each query block visits the
key/value blocks (inner loop), keeping a running output and log-sum-exp per query row.
Two partial results over disjoint key sets combine exactly (:func:`merge`)::

    lse = log(exp(lse₁) + exp(lse₂))
    out = exp(lse₁ - lse) · out₁ + exp(lse₂ - lse) · out₂

The backward pass recomputes each block's probabilities from the saved log-sum-exp
(``P = exp(S - lse)``), as in FlashAttention-2 (Dao, 2023, algorithm 2): only Q, K, V, the
output and the log-sum-exp are saved — O(s·d), not the O(s²) scores.

Per block, :func:`block_forward` / :func:`block_backward` call PyTorch's fused
flash-attention kernel when it returns the log-sum-exp (``impl="fused"``: the CPU kernel
``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), else the
pure-PyTorch reference (``impl="reference"``), which is also the specification the tests
compare against. Ring attention (:mod:`plait.parallel.context.ring_attention`) uses
the same block functions with the key/value blocks arriving from other ranks.

Shapes follow :func:`torch.nn.functional.scaled_dot_product_attention`: queries
``(batch, heads, seq_q, head_dim)``, keys/values ``(batch, kv_heads, seq_k, head_dim)``
with ``heads`` a multiple of ``kv_heads`` (grouped-query attention); the log-sum-exp is
``(batch, heads, seq_q)`` in :func:`acc_dtype` (natural logarithm): at least float32, so
16-bit inputs merge their partial results in float32 (the output is cast back).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

Impl = Literal["fused", "reference"]


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat each of ``t``'s KV heads for its group of query heads:
    ``(batch, kv_heads, s, d)`` -> ``(batch, heads, s, d)``."""
    g = heads // t.shape[1]
    return t if g == 1 else t.repeat_interleave(g, dim=1)


def reduce_kv(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum a gradient over each KV head's group: ``(batch, heads, s, d)`` ->
    ``(batch, kv_heads, s, d)`` (the adjoint of :func:`expand_kv`)."""
    b, h, s, d = t.shape
    g = h // kv_heads
    return t if g == 1 else t.view(b, kv_heads, g, s, d).sum(2)


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype partial results are merged in: ``t``'s, at least float32."""
    return torch.promote_types(t.dtype, torch.float32)


def _fused_ok(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, impl: Impl
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query block over one key block: ``(out, lse)``.

    ``q`` ``(b, h, sq, d)``, ``k``/``v`` ``(b, h, sk, d)`` (heads already expanded).
    ``causal`` masks key ``j`` for query ``i`` when ``j > i`` (both counted from the
    blocks' starts: a diagonal block). Rows with no visible key get ``lse = -inf``, out 0.
    """
    if impl == "fused" and _fused_ok(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale
        )
        return out, lse.to(acc_dtype(q))
    acc = acc_dtype(q)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (b, h, sq, sk)
    if causal:
        s = s.masked_fill(_causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (b, h, sq)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(p, v), lse


def _causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j > i  # (sq, sk), True = masked


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    impl: Impl,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of one block pair, from the *final* ``out`` and ``lse``
    of the query rows (over all key blocks), so ``P = exp(S - lse)`` are the true
    probabilities. ``dq`` is this block's contribution (sum over key blocks).

    ``dS = P ∘ (dP - D)`` with ``dP = dO Vᵀ`` and ``D = rowsum(dO ∘ O) - dlse``
    (the log-sum-exp's own gradient, when given, enters through ``D``).
    """
    if impl == "fused" and _fused_ok(q) and dlse is None:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(),
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            out.contiguous(),
            lse.contiguous(),
            0.0,
            causal,
            scale=scale,
        )
        return dq, dk, dv
    acc, dt = acc_dtype(q), q.dtype
    q, k, v, dout, out = (t.to(acc) for t in (q, k, v, dout, out))
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (b, h, sq, sk), recomputed
    if causal:
        s = s.masked_fill(_causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # (b, h, sq, sk)
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, v.transpose(-1, -2))
    d = (dout * out).sum(-1)  # (b, h, sq)
    if dlse is not None:
        d = d - dlse
    ds = p * (dp - d.unsqueeze(-1))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    return dq.to(dt), dk.to(dt), dv.to(dt)


def merge(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets into attention over their union.

    ``out`` ``(b, h, s, d)``, ``lse`` ``(b, h, s)``. Rows where both sides saw no key
    (``lse = -inf``) stay ``(0, -inf)``.
    """
    lse = torch.logaddexp(lse1, lse2)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    w1 = torch.where(finite, torch.exp(lse1 - safe), torch.zeros_like(lse)).unsqueeze(-1)
    w2 = torch.where(finite, torch.exp(lse2 - safe), torch.zeros_like(lse)).unsqueeze(-1)
    return w1 * out1 + w2 * out2, lse


def _ranges(n: int, block: int) -> list[tuple[int, int]]:
    return [(i, min(i + block, n)) for i in range(0, n, block)]


class _Blockwise(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        block: int,
        scale: float,
        impl: Impl,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        heads, sq, sk = q.shape[1], q.shape[2], k.shape[2]
        ke, ve = expand_kv(k, heads), expand_kv(v, heads)  # (b, h, sk, d)
        outs, lses = [], []
        for i0, i1 in _ranges(sq, block):  # query blocks: outer loop
            o = torch.zeros_like(q[:, :, i0:i1], dtype=acc_dtype(q))
            lse = torch.full(o.shape[:-1], float("-inf"), dtype=o.dtype, device=q.device)
            for j0, j1 in _ranges(sk, block):  # key blocks: inner loop, online softmax
                if causal and j0 > i1 - 1:
                    break  # every later key block is in the future
                diag = causal and j1 > i0 + 1
                ob, lb = block_forward(
                    q[:, :, i0:i1], ke[:, :, j0:j1], ve[:, :, j0:j1], diag, scale, impl
                )
                o, lse = merge(o, lse, ob, lb)
            outs.append(o)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block, ctx.scale, ctx.impl = causal, block, scale, impl
        return out, lse

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        causal, block, scale, impl = ctx.causal, ctx.block, ctx.scale, ctx.impl
        heads, sq, sk = q.shape[1], q.shape[2], k.shape[2]
        ke, ve = expand_kv(k, heads), expand_kv(v, heads)
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(ke)
        dv = torch.zeros_like(ve)
        for i0, i1 in _ranges(sq, block):
            dl = dlse[:, :, i0:i1] if dlse is not None else None
            for j0, j1 in _ranges(sk, block):
                if causal and j0 > i1 - 1:
                    break
                diag = causal and j1 > i0 + 1
                a, b, c = block_backward(
                    dout[:, :, i0:i1],
                    q[:, :, i0:i1],
                    ke[:, :, j0:j1],
                    ve[:, :, j0:j1],
                    out[:, :, i0:i1],
                    lse[:, :, i0:i1],
                    diag,
                    scale,
                    impl,
                    dl,
                )
                dq[:, :, i0:i1] += a
                dk[:, :, j0:j1] += b
                dv[:, :, j0:j1] += c
        return dq, reduce_kv(dk, k.shape[1]), reduce_kv(dv, v.shape[1]), None, None, None, None


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    block_size: int = 128,
    scale: float | None = None,
    impl: Impl = "fused",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (grouped-query) attention computed in blocks: ``(out, lse)``.

    ``q`` ``(batch, heads, seq_q, head_dim)``, ``k``/``v`` ``(batch, kv_heads, seq_k,
    head_dim)``; ``causal`` needs ``seq_q == seq_k`` (query ``i`` sees keys ``0..i``).
    ``block_size`` is the query and key block length; ``scale`` defaults to
    ``1/sqrt(head_dim)``. Differentiable in ``q``, ``k``, ``v`` through both outputs.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"causal blockwise attention needs as many queries as keys ({q.shape[2]} vs "
            f"{k.shape[2]})"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = _Blockwise.apply(q, k, v, causal, block_size, sc, impl)
    return out, lse
