"""Ring attention over the cp axis (Liu, Zaharia & Abbeel, 2023, "Ring Attention with
Blockwise Transformers"; load balance as in Brandon et al., 2023 "Striped Attention" /
the zigzag layout of ring-flash-attn and torchtitan).

Each cp rank keeps its queries; the key/value blocks travel around the ring
(rank ``r`` sends to ``r + 1`` and receives from ``r - 1``). At step ``t`` a rank computes
its queries against the block of rank ``r - t`` with
:func:`plait.model.blockwise_attention.block_forward` while the block for step ``t + 1``
is already in flight (two buffers: the one computed on is sent on, the other
receives), and merges the partial results exactly by their log-sum-exp. After ``cp - 1``
transfers every rank has seen every block.

Backward recomputes from the saved output and log-sum-exp. The K/V blocks go around
the ring once more and a dK/dV accumulator travels with each block: rank ``r`` visits
the blocks of ``r - 1, r - 2, …, r + 1`` and then its own, so the accumulator for block
``b`` starts at ``b + 1``, collects one contribution per rank and arrives at ``b`` after
``cp - 1`` hops, where the owner adds its own part. Per layer and rank: forward
``cp - 1`` K/V blocks sent (and received); backward ``cp - 1`` K/V blocks plus ``cp - 1``
dK/dV blocks of the same size.

The local sequence holds two chunks (:mod:`.layout`); a chunk pair (query chunk ``a``,
key chunk ``b``, global indices) is fully visible when ``b < a``, a causal diagonal when
``b == a`` and skipped when ``b > a``. With the zigzag layout every rank computes the same
number of pairs. :meth:`RingAttention.plan` turns a step's visible chunk pairs into as
few kernel calls over whole chunks as possible (one per step under both layouts: a
fused kernel tiles them itself), and with document ids (``doc_ids``: the whole
sequence's, :mod:`plait.model.document_mask`) one call per step whose additive mask holds
the documents and the causal order by global position; steps where no query sees a key
are skipped. A sliding window (``window``, global positions) is classified the same way
(:mod:`plait.model.block_plan`): a step whose keys all lie before every query's window
is skipped, a partly visible one gets a mask. Every step's calls are planned on the
host once per batch (no host sync per step). :attr:`RingAttention.pairs` counts the
(query, key) pairs computed and
:attr:`RingAttention.events` records (what, step, seconds) when asked, so tests can check
the balance and the overlap.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from plait import comm
from plait.comm import AxisGroup, Handle
from plait.model.block_plan import Kind, Spans, Visibility, cached, classify
from plait.model.blockwise_attention import (
    Impl,
    acc_dtype,
    block_backward,
    block_forward,
    expand_kv,
    merge,
    reduce_kv,
)
from plait.model.document_mask import additive, visible
from plait.parallel.context.layout import SeqLayout, chunk_ids, local_positions, shard_sequence

KV_TAG, GRAD_TAG = 0, 1
Call = tuple[slice, slice, bool, "torch.Tensor | None"]
"""One kernel call: query rows, key columns (local indices), causal diagonal, additive
mask ``(b or 1, 1, rows, cols)`` or None."""
StepCall = tuple[slice, slice, Kind]
"""One planned call of a ring step: query rows, key columns (local), how (full, causal,
masked)."""


class RingAttention(nn.Module):
    """Attention core for a cp group: ``forward(q, k, v) -> out``.

    ``q`` ``(batch, heads, local_seq, head_dim)``, ``k``/``v`` ``(batch, kv_heads,
    local_seq, head_dim)``, the local sequence being this rank's two chunks in
    ``layout``. ``impl`` selects the per-block kernel ("fused" or "reference").
    """

    def __init__(
        self,
        group: AxisGroup,
        *,
        causal: bool = True,
        layout: SeqLayout = "zigzag",
        impl: Impl = "fused",
        record_events: bool = False,
        window: int | None = None,
    ) -> None:
        super().__init__()
        if window is not None and (not causal or window < 1):
            raise ValueError(
                f"a sliding window needs causal attention and window >= 1, got {window}"
            )
        self.group = group
        self.causal = causal
        self.window = window
        """Sliding window in global positions (query p sees keys p - window < j <= p)."""
        self.layout: SeqLayout = layout
        self.impl: Impl = impl
        self.record_events = record_events
        self.events: list[tuple[str, int, float]] = []
        """(what, step, perf_counter seconds): post, compute_start, compute_end, wait."""
        self.pairs = 0
        """(query, key) score pairs computed so far, forward only (per batch row × head), by
        causal order alone (documents and a window not subtracted)."""

    def _event(self, what: str, step: int) -> None:
        if self.record_events:
            self.events.append((what, step, time.perf_counter()))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the local queries over the whole (cp-sharded) sequence;
        ``doc_ids`` ``(batch, S)``: the document ids of the *whole* sequence (every rank
        holds them; each rank's and each block's ids follow the layout)."""
        if q.shape[2] % 2:
            raise ValueError(f"ring attention needs two equal chunks per rank, got {q.shape[2]}")
        if doc_ids is not None and doc_ids.shape[1] != q.shape[2] * self.group.size:
            raise ValueError(
                f"doc_ids cover {doc_ids.shape[1]} tokens; the whole sequence has "
                f"{q.shape[2] * self.group.size}"
            )
        out: torch.Tensor = _Ring.apply(q, k, v, self, doc_ids)
        return out

    # ------------------------------------------------------------ block pairs

    def _visible(self, a: int, b: int) -> str:
        """How query chunk ``a`` sees key chunk ``b``: full, diag or none."""
        if not self.causal or b < a:
            return "full"
        return "diag" if a == b else "none"

    def plan(self, src: int, local: int, spans: Spans) -> list[StepCall]:
        """The kernel calls of the local queries against rank ``src``'s block, decided on
        the host: as few as the layout allows, each over whole chunks (a fused kernel
        tiles them itself).

        Each chunk pair (query ``a``, key ``b``, global positions) is classified by
        :func:`~plait.model.block_plan.classify` from causal order, the window and the
        documents' ``spans`` (:func:`~plait.model.block_plan.document_spans` of the
        whole sequence; None: no documents): skip, full, a causal diagonal or masked.
        When a pair needs a mask, the visible pairs' rectangle is one masked call (the
        mask, by global position, is built on the device). When the visible pairs fill a
        rectangle of full pairs (every ring step but one under zigzag without a
        window), or the block is this rank's own (``causal, skip / full, causal``:
        causal over the local sequence, whose chunks are in increasing order), one call
        does them; otherwise one call per visible pair. Empty: the step is skipped.
        """
        cp, me, c = self.group.size, self.group.index, local // 2
        mine, theirs = chunk_ids(self.layout, cp, me), chunk_ids(self.layout, cp, src)
        vis = Visibility(self.causal, self.window, spans, cp * local)
        how: dict[tuple[int, int], Kind] = {}
        for i, a in enumerate(mine):
            pos = np.arange(a * c, (a + 1) * c)
            lo, hi = vis.bounds(pos)
            for j, b in enumerate(theirs):
                how[(i, j)] = classify(pos, lo, hi, b * c, (b + 1) * c)
        seen = [ij for ij, h in how.items() if h != "skip"]
        if not seen:
            return []
        rows, cols = sorted({i for i, _ in seen}), sorted({j for _, j in seen})
        rs, cs = slice(rows[0] * c, (rows[-1] + 1) * c), slice(cols[0] * c, (cols[-1] + 1) * c)
        if any(how[ij] == "masked" for ij in seen):
            return [(rs, cs, "masked")]
        if all(how[(i, j)] == "full" for i in rows for j in cols):
            return [(rs, cs, "full")]
        if how == {(0, 0): "causal", (0, 1): "skip", (1, 0): "full", (1, 1): "causal"}:
            return [(rs, cs, "causal")]
        return [
            (slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c), how[(i, j)]) for i, j in seen
        ]

    def plans(self, local: int, docs: torch.Tensor | None) -> list[list[StepCall]]:
        """:meth:`plan` of every ring step (index: the source rank), built once per batch
        on the host (kept on the ids tensor, which every layer shares)."""
        cp = self.group.size
        key = ("ring", self.layout, cp, self.group.index, local, self.causal, self.window)
        build = lambda spans: [self.plan(src, local, spans) for src in range(cp)]  # noqa: E731
        return build(None) if docs is None else cached(docs, key, build)

    def _bias(
        self,
        docs: torch.Tensor | None,
        src: int,
        rs: slice,
        cs: slice,
        local: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """The additive mask ``(b or 1, 1, rows, cols)`` of a masked call: documents,
        causal order and the window by global position."""
        cp, me = self.group.size, self.group.index
        q_pos = k_pos = None
        if self.causal:
            q_pos = local_positions(self.layout, cp, me, local)[rs].to(device)
            k_pos = local_positions(self.layout, cp, src, local)[cs].to(device)
        q_doc = k_doc = None
        if docs is not None:
            q_doc = shard_sequence(docs, self.layout, cp, me, dim=1)[:, rs]  # (b, rows)
            k_doc = shard_sequence(docs, self.layout, cp, src, dim=1)[:, cs]
        return additive(visible(q_doc, k_doc, q_pos, k_pos, self.window), dtype)

    def calls(
        self,
        step: list[StepCall],
        src: int,
        local: int,
        docs: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[Call]:
        """A step's planned calls with their masks (built on the device)."""
        return [
            (
                rs,
                cs,
                kind == "causal",
                self._bias(docs, src, rs, cs, local, dtype, device) if kind == "masked" else None,
            )
            for rs, cs, kind in step
        ]

    def _count(self, q: torch.Tensor, src: int) -> None:
        cp, me, n = self.group.size, self.group.index, q.shape[2] // 2
        for a in chunk_ids(self.layout, cp, me):
            for b in chunk_ids(self.layout, cp, src):
                how = self._visible(a, b)
                if how != "none":
                    per = n * n if how == "full" else n * (n + 1) // 2
                    self.pairs += q.shape[0] * q.shape[1] * per

    def attend(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        src: int,
        o: torch.Tensor,
        lse: torch.Tensor,
        docs: torch.Tensor | None = None,
        step: list[StepCall] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge the local queries' attention over rank ``src``'s block ``kv``
        ``(2, b, kv_heads, local, d)`` into ``(o, lse)`` (updated in place); ``step`` is
        the step's :meth:`plan` (default: planned now)."""
        heads, local = q.shape[1], q.shape[2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        if step is None:
            step = self.plans(local, docs)[src]
        ke, ve = expand_kv(kv[0], heads), expand_kv(kv[1], heads)  # (b, heads, local, d)
        for rs, cs, causal, bias in self.calls(step, src, local, docs, o.dtype, q.device):
            ob, lb = block_forward(
                q[:, :, rs], ke[:, :, cs], ve[:, :, cs], causal, scale, self.impl, bias
            )
            o[:, :, rs], lse[:, :, rs] = merge(o[:, :, rs], lse[:, :, rs], ob, lb)
        self._count(q, src)
        return o, lse

    def attend_backward(
        self,
        saved: tuple[torch.Tensor, ...],
        kv: torch.Tensor,
        src: int,
        dq: torch.Tensor,
        docs: torch.Tensor | None = None,
        step: list[StepCall] | None = None,
    ) -> torch.Tensor:
        """Add the local queries' gradient against block ``kv`` of rank ``src`` into
        ``dq`` and return that block's dK/dV contribution ``(2, b, kv_heads, local, d)``
        (zeros when the step is skipped)."""
        dout, q, out, lse = saved
        heads, hk, local = q.shape[1], kv.shape[2], q.shape[2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        if step is None:
            step = self.plans(local, docs)[src]
        if not step:
            return torch.zeros_like(kv)
        ke, ve = expand_kv(kv[0], heads), expand_kv(kv[1], heads)
        dk = torch.zeros_like(ke, dtype=dq.dtype)  # (b, heads, local, d), accumulated
        dv = torch.zeros_like(ve, dtype=dq.dtype)
        for rs, cs, causal, bias in self.calls(step, src, local, docs, dq.dtype, q.device):
            g_q, g_k, g_v = block_backward(
                dout[:, :, rs],
                q[:, :, rs],
                ke[:, :, cs],
                ve[:, :, cs],
                out[:, :, rs],
                lse[:, :, rs],
                causal,
                scale,
                self.impl,
                None,
                bias,
            )
            dq[:, :, rs] += g_q
            dk[:, :, cs] += g_k
            dv[:, :, cs] += g_v
        return torch.stack((reduce_kv(dk, hk), reduce_kv(dv, hk))).to(kv.dtype)


def _exchange(
    ring: RingAttention, send: torch.Tensor, recv: torch.Tensor, tag: int, step: int
) -> list[Handle]:
    """Post the send of ``send`` to the next rank and the receive of ``recv`` from the
    previous one (asynchronous; wait on the handles)."""
    g = ring.group
    nxt, prv = (g.index + 1) % g.size, (g.index - 1) % g.size
    ring._event("post", step)
    return [comm.isend(send, g, nxt, tag=tag), comm.irecv(recv, g, prv, tag=tag)]


def _wait(ring: RingAttention, handles: list[Handle], step: int) -> None:
    for h in handles:
        h.wait()
    ring._event("wait", step)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ring: RingAttention,
        docs: torch.Tensor | None,
    ) -> torch.Tensor:
        cp, me = ring.group.size, ring.group.index
        cur = torch.stack((k, v))  # (2, b, kv_heads, local, d): one message per block
        nxt = torch.empty_like(cur)
        o = torch.zeros_like(q, dtype=acc_dtype(q))  # (b, heads, local, d), merged in >= fp32
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=o.dtype, device=q.device)
        plans = ring.plans(q.shape[2], docs)  # every step's calls, on the host
        for t in range(cp):
            handles = _exchange(ring, cur, nxt, KV_TAG, t + 1) if t < cp - 1 else []
            ring._event("compute_start", t)
            src = (me - t) % cp
            o, lse = ring.attend(q, cur, src, o, lse, docs, plans[src])
            ring._event("compute_end", t)
            _wait(ring, handles, t + 1)
            cur, nxt = nxt, cur
        o = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse, docs)
        ctx.ring, ctx.plans = ring, plans
        return o

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, docs = ctx.saved_tensors
        ring: RingAttention = ctx.ring
        plans: list[list[StepCall]] = ctx.plans
        cp, me = ring.group.size, ring.group.index
        saved = (dout.contiguous(), q, out, lse)
        dq = torch.zeros_like(q, dtype=acc_dtype(q))  # accumulated over the ring steps
        own = torch.stack((k, v))
        if cp == 1:
            dkv = ring.attend_backward(saved, own, me, dq, docs, plans[me])
            return dq.to(q.dtype), dkv[0], dkv[1], None, None
        cur, nxt = torch.empty_like(own), torch.empty_like(own)
        kv_handles = _exchange(ring, own, cur, KV_TAG, 0)  # block of r - 1 for step 0
        acc_in = torch.empty_like(own)
        acc_out = torch.empty_like(own)
        sent: list[Handle] = []
        for t in range(cp - 1):  # blocks of r-1, r-2, ..., r+1
            _wait(ring, kv_handles, t)
            kv_handles = _exchange(ring, cur, nxt, KV_TAG, t + 1) if t < cp - 2 else []
            acc_h = [comm.irecv(acc_in, ring.group, (me - 1) % cp, tag=GRAD_TAG)] if t else []
            ring._event("compute_start", t)
            src = (me - 1 - t) % cp
            part = ring.attend_backward(saved, cur, src, dq, docs, plans[src])
            ring._event("compute_end", t)
            for h in sent + acc_h:  # acc_out is free again; the partial sum arrived
                h.wait()
            acc_out.copy_(part + acc_in if t else part)
            sent = [comm.isend(acc_out, ring.group, (me + 1) % cp, tag=GRAD_TAG)]
            if t < cp - 2:
                cur, nxt = nxt, cur
        final = comm.irecv(acc_in, ring.group, (me - 1) % cp, tag=GRAD_TAG)
        ring._event("compute_start", cp - 1)
        mine = ring.attend_backward(saved, own, me, dq, docs, plans[me])
        ring._event("compute_end", cp - 1)
        final.wait()
        for h in sent:
            h.wait()
        dkv = mine + acc_in
        return dq.to(q.dtype), dkv[0], dkv[1], None, None
