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

Per block, :func:`block_forward` / :func:`block_backward` call the fused kernel of the
device that returns the log-sum-exp (``impl="fused"``, :mod:`plait.model.attention_kernels`:
``aten._scaled_dot_product_flash_attention_for_cpu`` on the CPU; on CUDA the flash,
memory-efficient or cuDNN kernel SDPA would pick, in bf16/fp16) and their backward given
a log-sum-exp, else the pure-PyTorch reference (``impl="reference"``, also float64 on
CUDA), which is the specification the tests compare against. A fused kernel tiles the
keys itself, so a query block hands it all its fully visible keys as one range plus its
diagonal block (two calls and one merge per query block, not one per key block).
Ring attention (:mod:`plait.parallel.context.ring_attention`) uses the same block
functions with the key/value blocks arriving from other ranks. Document masking
(``doc_ids``, :mod:`plait.model.document_mask`) and a sliding window (``window``) pass
each range's mask as an additive bias and skip ranges where no query sees a key; which
ranges those are is a :class:`~plait.model.block_plan.BlockPlan` built on the host once
per batch, so the loops hold no host sync.

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

from plait.model import attention_kernels as kernels
from plait.model.block_plan import BlockPlan, Visibility, blockwise_plan, cached
from plait.model.document_mask import additive, visible

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


def _coalesce(q: torch.Tensor, impl: Impl) -> bool:
    """Whether a fused kernel serves ``q``'s device and dtype: it tiles the keys
    itself, so the visible key blocks of a query block go to it as one range."""
    return impl == "fused" and kernels.available(q)


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    impl: Impl,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query block over one key block: ``(out, lse)``.

    ``q`` ``(b, h, sq, d)``, ``k``/``v`` ``(b, h, sk, d)`` (heads already expanded).
    ``causal`` masks key ``j`` for query ``i`` when ``j > i`` (both counted from the
    blocks' starts: a diagonal block). ``bias`` ``(b, 1, sq, sk)`` (0 or -inf; then
    ``causal`` is False, the bias holds the causal part) is added to the scores.
    Rows with no visible key get ``lse = -inf``, out 0. ``impl="fused"`` uses the fused
    kernel of q's device (:mod:`plait.model.attention_kernels`) where there is one.
    """
    if impl == "fused":
        got = kernels.fused_forward(q, k, v, causal, scale, bias)
        if got is not None:
            return got
    acc = acc_dtype(q)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    s = _scores(q, k, causal, scale, bias)  # (b, h, sq, sk)
    lse = torch.logsumexp(s, dim=-1)  # (b, h, sq)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(p, v), lse


def _scores(
    q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, bias: torch.Tensor | None
) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (b, h, sq, sk)
    if causal:
        s = s.masked_fill(_causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    if bias is not None:
        s = s + bias.to(s.dtype)
    return s


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
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of one block pair, from the *final* ``out`` and ``lse``
    of the query rows (over all key blocks), so ``P = exp(S - lse)`` are the true
    probabilities. ``dq`` is this block's contribution (sum over key blocks).

    ``dS = P ∘ (dP - D)`` with ``dP = dO Vᵀ`` and ``D = rowsum(dO ∘ O) - dlse``
    (the log-sum-exp's own gradient, when given, enters through ``D``; the fused
    kernels take none, so a given ``dlse`` uses the reference).
    """
    if impl == "fused" and dlse is None:
        grads = kernels.fused_backward(dout, q, k, v, out.to(q.dtype), lse, causal, scale, bias)
        if grads is not None:
            return grads
    acc, dt = acc_dtype(q), q.dtype
    q, k, v, dout, out = (t.to(acc) for t in (q, k, v, dout, out))
    s = _scores(q, k, causal, scale, bias)  # (b, h, sq, sk), recomputed
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


def plan_for(
    sq: int,
    sk: int,
    block: int,
    causal: bool,
    coalesce: bool,
    docs: torch.Tensor | None,
    window: int | None,
) -> BlockPlan:
    """The :class:`~plait.model.block_plan.BlockPlan` of one call, built on the host (the
    document ids copied once per batch and the plan kept on the ids tensor, which every
    layer shares): no host sync inside the kernels' loops."""
    build = lambda spans: blockwise_plan(  # noqa: E731
        sq, sk, block, causal, coalesce, Visibility(causal, window, spans, sk)
    )
    if docs is None:
        return build(None)
    return cached(docs, ("blockwise", sq, sk, block, causal, coalesce, window), build)


def segment_bias(
    docs: torch.Tensor | None,
    i0: int,
    i1: int,
    j0: int,
    j1: int,
    causal: bool,
    window: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The additive mask ``(b or 1, 1, i1 - i0, j1 - j0)`` of a masked range (documents,
    causal order and the window, by position), built on the device (a window alone:
    one mask for every row of the batch, broadcast)."""
    q_pos = torch.arange(i0, i1, device=device) if causal else None
    k_pos = torch.arange(j0, j1, device=device) if causal else None
    q_doc = docs[:, i0:i1] if docs is not None else None
    k_doc = docs[:, j0:j1] if docs is not None else None
    return additive(visible(q_doc, k_doc, q_pos, k_pos, window), dtype)


def _calls(
    plan: BlockPlan,
    docs: torch.Tensor | None,
    causal: bool,
    window: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[int, int, list[tuple[int, int, bool, torch.Tensor | None]]]]:
    """Per query block ``(i0, i1, [(j0, j1, diagonal, bias)])`` for the kernels."""
    out = []
    for qb in plan.blocks:
        segs = []
        for sg in qb.segments:
            bias = None
            if sg.kind == "masked":
                bias = segment_bias(docs, qb.i0, qb.i1, sg.j0, sg.j1, causal, window, dtype, device)
            segs.append((sg.j0, sg.j1, sg.kind == "causal", bias))
        out.append((qb.i0, qb.i1, segs))
    return out


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
        docs: torch.Tensor | None,
        window: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)  # an unused lse gets no (zero) gradient
        heads, sq, sk = q.shape[1], q.shape[2], k.shape[2]
        ke, ve = expand_kv(k, heads), expand_kv(v, heads)  # (b, h, sk, d)
        acc, coalesce = acc_dtype(q), _coalesce(q, impl)
        plan = plan_for(sq, sk, block, causal, coalesce, docs, window)  # on the host
        outs, lses = [], []
        for i0, i1, segs in _calls(plan, docs, causal, window, acc, q.device):  # query blocks
            o = torch.zeros_like(q[:, :, i0:i1], dtype=acc)
            lse = torch.full(o.shape[:-1], float("-inf"), dtype=acc, device=q.device)
            for n, (j0, j1, diag, bias) in enumerate(segs):  # key ranges: online softmax
                ob, lb = block_forward(
                    q[:, :, i0:i1], ke[:, :, j0:j1], ve[:, :, j0:j1], diag, scale, impl, bias
                )
                o, lse = (ob.to(acc), lb) if n == 0 else merge(o, lse, ob, lb)
            outs.append(o)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse, docs)
        ctx.causal, ctx.block, ctx.scale, ctx.impl = causal, block, scale, impl
        ctx.window, ctx.plan = window, plan
        return out, lse

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, docs = ctx.saved_tensors
        causal, scale, impl, window = ctx.causal, ctx.scale, ctx.impl, ctx.window
        heads = q.shape[1]
        dout = torch.zeros_like(out) if dout is None else dout
        ke, ve = expand_kv(k, heads), expand_kv(v, heads)
        none = (None,) * 6
        coalesce = _coalesce(q, impl)
        if coalesce and docs is None and window is None and dlse is None:
            # FlashAttention-2's backward is itself blockwise (key blocks outer, query
            # blocks inner) and needs only the final out and lse: one call over the
            # whole sequence gives every block's gradient without Python-level
            # accumulation of dK/dV.
            grads = kernels.fused_backward(dout, q, ke, ve, out, lse, causal, scale)
            if grads is not None:
                dq, dk, dv = grads
                return dq, reduce_kv(dk, k.shape[1]), reduce_kv(dv, v.shape[1]), *none
        acc = acc_dtype(q)
        dq = torch.zeros_like(q, dtype=acc)
        dk = torch.zeros_like(ke, dtype=acc)
        dv = torch.zeros_like(ve, dtype=acc)
        for i0, i1, segs in _calls(ctx.plan, docs, causal, window, acc, q.device):
            dl = dlse[:, :, i0:i1] if dlse is not None else None
            for j0, j1, diag, bias in segs:
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
                    bias,
                )
                dq[:, :, i0:i1] += a
                dk[:, :, j0:j1] += b
                dv[:, :, j0:j1] += c
        dk, dv = reduce_kv(dk, k.shape[1]), reduce_kv(dv, v.shape[1])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *none


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    block_size: int = 128,
    scale: float | None = None,
    impl: Impl = "fused",
    doc_ids: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (grouped-query) attention computed in blocks: ``(out, lse)``.

    ``q`` ``(batch, heads, seq_q, head_dim)``, ``k``/``v`` ``(batch, kv_heads, seq_k,
    head_dim)``; ``causal`` needs ``seq_q == seq_k`` (query ``i`` sees keys ``0..i``).
    ``block_size`` is the query block length (and the key block length of the
    reference; a fused kernel takes the visible keys as one range); ``scale`` defaults
    to ``1/sqrt(head_dim)``. ``doc_ids`` ``(batch, seq)`` (self-attention: seq_q ==
    seq_k) restricts attention to tokens of the same document
    (:mod:`plait.model.document_mask`). ``window`` (causal only) is a sliding window:
    query ``i`` sees keys ``i - window < j <= i``; key blocks wholly outside it are not
    visited. Which key ranges each query block visits is decided on the host before the
    kernels (:mod:`plait.model.block_plan`). Differentiable in ``q``, ``k``, ``v``
    through both outputs.

    The forward runs block by block on every device. The backward of a fused kernel
    without documents and without a gradient on ``lse`` is one kernel call over the
    whole sequence (the kernel is blockwise inside); otherwise it runs block by block.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if (causal or doc_ids is not None) and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"causal or document-masked blockwise attention needs as many queries as keys "
            f"({q.shape[2]} vs {k.shape[2]})"
        )
    if window is not None and (not causal or window < 1):
        raise ValueError(f"a sliding window needs causal attention and window >= 1, got {window}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if doc_ids is not None and tuple(doc_ids.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"doc_ids must be (batch, seq) = {(q.shape[0], q.shape[2])}, got {tuple(doc_ids.shape)}"
        )
    sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = _Blockwise.apply(q, k, v, causal, block_size, sc, impl, doc_ids, window)
    return out, lse
