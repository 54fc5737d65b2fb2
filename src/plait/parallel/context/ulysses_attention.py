"""All-to-all (DeepSpeed-Ulysses) attention over the cp axis (Jacobs et al., 2023,
"DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence
Transformer Models").

Each cp rank holds a contiguous sequence shard with all heads. An all-to-all
re-partitions Q, K and V to (whole sequence, ``heads / cp`` heads); each rank attends
over the whole sequence for its heads (plain fused attention, nothing to merge); a
fourth all-to-all brings the output back to (sequence shard, all heads). Backward runs
the inverse all-to-all of each (four more). #ranks = #sequence shards = #head shards, so
the query heads must be divisible by cp; KV heads fewer than cp (or not divisible by it)
are repeated up to the query heads first (GQA replicated), costing extra bytes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.comm import AxisGroup
from plait.model.blockwise_attention import expand_kv
from plait.model.document_mask import visible


def seq_to_heads(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """``(b, h, s/cp, d)`` sequence shard -> ``(b, h/cp, s, d)`` head shard (AllToAll)."""
    b, h, n, d = x.shape
    cp = g.size
    send = x.view(b, cp, h // cp, n, d).transpose(0, 1)  # (cp, b, h/cp, n, d): to rank j
    got = comm.all_to_all(send.contiguous(), g)
    assert isinstance(got, torch.Tensor)
    # got[i]: rank i's sequence shard of my heads -> (b, h/cp, cp·n, d)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * n, d)


def heads_to_seq(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """``(b, h/cp, s, d)`` head shard -> ``(b, h, s/cp, d)`` sequence shard (AllToAll)."""
    b, hl, s, d = x.shape
    cp = g.size
    send = x.view(b, hl, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # (cp, b, h/cp, n, d)
    got = comm.all_to_all(send.contiguous(), g)
    assert isinstance(got, torch.Tensor)
    # got[i]: my sequence shard of rank i's heads -> (b, cp·h/cp, n, d)
    return got.transpose(0, 1).reshape(b, cp * hl, s // cp, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
        ctx.g = g
        return seq_to_heads(x, g)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        return heads_to_seq(dy.contiguous(), ctx.g), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
        ctx.g = g
        return heads_to_seq(x, g)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        return seq_to_heads(dy.contiguous(), ctx.g), None


class UlyssesAttention(nn.Module):
    """Attention core for a cp group: ``forward(q, k, v) -> out`` on contiguous
    sequence shards (``q`` ``(batch, heads, s/cp, d)``, ``k``/``v`` ``(batch, kv_heads,
    s/cp, d)``)."""

    def __init__(self, group: AxisGroup, *, causal: bool = True, window: int | None = None) -> None:
        super().__init__()
        if window is not None and (not causal or window < 1):
            raise ValueError(
                f"a sliding window needs causal attention and window >= 1, got {window}"
            )
        self.group = group
        self.causal = causal
        self.window = window
        """Sliding window (query p sees keys p - window < j <= p; whole-sequence positions)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """All-to-all to head shards, attention over the whole sequence, and back;
        ``doc_ids`` ``(batch, S)`` (the whole sequence's) add the block-causal mask, and
        the window its band (after the all-to-all each rank holds the whole sequence, so
        positions are global)."""
        g, heads, kv_heads = self.group, q.shape[1], k.shape[1]
        if heads % g.size:
            raise ValueError(f"Ulysses attention: {heads} heads are not divisible by cp={g.size}")
        if kv_heads % g.size:  # fewer KV heads than ranks: replicate them per query head
            k, v = expand_kv(k, heads), expand_kv(v, heads)
        qh = _SeqToHeads.apply(q, g)  # (b, heads/cp, s, d)
        kh = _SeqToHeads.apply(k, g)  # (b, kv_heads/cp, s, d)
        vh = _SeqToHeads.apply(v, g)
        gqa = qh.shape[1] != kh.shape[1]
        if doc_ids is not None or self.window is not None:
            pos = torch.arange(qh.shape[2], device=qh.device) if self.causal else None
            mask = visible(doc_ids, doc_ids, pos, pos, self.window)  # (b or 1, 1, s, s)
            heads_l = qh.shape[1]  # the masked CUDA kernels take no GQA: expand K/V
            kh, vh = expand_kv(kh, heads_l), expand_kv(vh, heads_l)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=self.causal, enable_gqa=gqa)
        out: torch.Tensor = _HeadsToSeq.apply(o, g)  # (b, heads, s/cp, d)
        return out
