"""Attention of the built-in transformer: the one-device cores (SDPA, blockwise) and the
grouped-query self-attention module with its family features (biases, head width, q/k
norms, Gemma's score scale and soft-capping, per-layer-type RoPE)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig
from plait.config.model import layer_window
from plait.errors import ConfigError
from plait.model.blockwise_attention import blockwise_attention
from plait.model.document_mask import visible
from plait.model.norms import ProjectionRMSNorm, RMSNorm
from plait.model.rope import apply_rotary

_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


class SDPAttention(nn.Module):
    """Causal grouped-query attention core through torch's fused
    :func:`~torch.nn.functional.scaled_dot_product_attention`:
    ``forward(q, k, v)`` with ``q`` ``(batch, heads, seq, head_dim)`` and ``k``/``v``
    ``(batch, kv_heads, seq, head_dim)`` -> ``(batch, heads, seq, head_dim)``.
    ``doc_ids`` ``(batch, seq)``: a boolean block-causal mask (same document, not later);
    ``window``: a sliding window (query ``i`` sees keys ``i - window < j <= i``);
    ``scale``: the score scale (None: ``1/sqrt(head_dim)``); ``softcap``: scores become
    ``softcap · tanh(s / softcap)`` before the mask, computed with explicit scores
    (:func:`capped_attention`; SDPA cannot cap)."""

    def __init__(
        self, window: int | None = None, scale: float | None = None, softcap: float | None = None
    ) -> None:
        super().__init__()
        self.window = window
        self.scale = scale
        self.softcap = softcap

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal attention of ``q`` over ``k``/``v`` (within documents when given)."""
        groups = q.shape[1] // k.shape[1]
        if self.softcap is not None:
            return capped_attention(q, k, v, doc_ids, self.window, self.scale, self.softcap)
        if doc_ids is not None or self.window is not None:
            return doc_sdpa(q, k, v, doc_ids, self.window, self.scale)
        if groups == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        if _SDPA_HAS_GQA:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True, scale=self.scale
            )
        k = k.repeat_interleave(groups, dim=1)  # torch < 2.5: (batch, heads, seq, head_dim)
        v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)


def doc_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor | None,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA with the block-causal mask of ``doc_ids`` ``(batch, seq)`` and the sliding
    ``window`` (``(batch or 1, 1, seq, seq)`` bool; every row sees at least itself, so
    no row is fully masked)."""
    pos = torch.arange(q.shape[2], device=q.device)
    mask = visible(doc_ids, doc_ids, pos, pos, window)  # (batch or 1, 1, seq, seq)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor | None,
    window: int | None,
    scale: float | None,
    softcap: float,
) -> torch.Tensor:
    """Causal attention with explicit scores ``(batch, heads, seq, seq)`` soft-capped
    (``softcap · tanh(s / softcap)``, Gemma 2) before the causal/document/window mask;
    softmax in float32 as transformers' eager attention."""
    pos = torch.arange(q.shape[2], device=q.device)
    mask = visible(doc_ids, doc_ids, pos, pos, window)  # (batch or 1, 1, seq, seq)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    s = torch.tanh(s / softcap) * softcap  # (batch, heads, seq, seq)
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)  # (batch, heads, seq, head_dim)


class BlockwiseAttention(nn.Module):
    """Causal attention core computed block by block with an online softmax
    (:func:`~plait.model.blockwise_attention.blockwise_attention`); same call as
    :class:`SDPAttention`."""

    def __init__(
        self, block_size: int = 128, window: int | None = None, scale: float | None = None
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.window = window
        self.scale = scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal attention of ``q`` over ``k``/``v`` (within documents when given)."""
        out, _ = blockwise_attention(
            q,
            k,
            v,
            causal=True,
            block_size=self.block_size,
            scale=self.scale,
            doc_ids=doc_ids,
            window=self.window,
        )
        return out


def attention_core(
    kind: str,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> nn.Module:
    """The one-device attention core named by ``model.attention`` (``window``: the
    layer's sliding window, :func:`~plait.config.model.layer_window`; ``scale``: the
    score scale, None for ``1/sqrt(head_dim)``; ``softcap``: 'sdpa' only, the config
    refuses it with 'blockwise')."""
    if kind == "blockwise":
        if softcap is not None:
            raise ConfigError("model.attn_logit_softcap needs model.attention = 'sdpa'.")
        return BlockwiseAttention(window=window, scale=scale)
    if kind == "sdpa":
        return SDPAttention(window, scale, softcap)
    raise ConfigError(f"model.attention must be sdpa or blockwise, got {kind!r}.")


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions.

    The head counts used in :meth:`forward` are read from the projection shapes, so a
    wrapper may shard ``wq``/``wk``/``wv`` by output rows (whole heads) and ``wo`` by
    input columns without changing this code. ``core`` computes attention from the
    rotated heads (``model.attention``); context parallelism replaces it from outside
    with an attention that spans the cp ranks. ``doc_ids`` (document masking) are
    passed to the core only when given, so a core may take ``(q, k, v)`` alone.

    The family features of ``cfg``: projection biases (``attention_bias``), a head width
    other than ``dim / n_heads`` (``head_width``) and RMSNorms of queries and keys before
    RoPE (``qk_norm``: ``q_norm``/``k_norm`` of ``head_dim`` per head, or of the whole
    projection; ``(1 + w)`` with ``norm_unit_offset``), the score scale
    ``query_pre_attn_scalar ** -0.5``, attention-logit soft-capping, and per-layer-type
    RoPE: with ``rope_local_theta`` the rotary tables hold the global layers' angles in
    their first ``head_dim / 2`` columns and the sliding layers' in the last, and each
    layer takes its half (:meth:`rope_half`).
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        hd = self.head_dim = cfg.head_dim
        qkv_bias = cfg.attention_bias != "none"
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=cfg.attention_bias == "qkvo")
        self.qk_norm = cfg.qk_norm
        off = cfg.norm_unit_offset
        if cfg.qk_norm == "head":
            self.q_norm: nn.Module = RMSNorm(hd, cfg.norm_eps, off)  # (head_dim,)
            self.k_norm: nn.Module = RMSNorm(hd, cfg.norm_eps, off)
        elif cfg.qk_norm == "projection":
            self.q_norm = ProjectionRMSNorm(cfg.n_heads * hd, cfg.norm_eps, off)  # (heads·hd,)
            self.k_norm = ProjectionRMSNorm(cfg.kv_heads * hd, cfg.norm_eps, off)
        window = layer_window(cfg, layer)
        scalar = cfg.query_pre_attn_scalar
        # query_pre_attn_scalar equal to the head width is the default scale (Gemma 3's
        # smaller models): left None, so that context parallelism's kernels apply
        scale = None if scalar is None or scalar == hd else scalar**-0.5
        self.core = attention_core(cfg.attention, window, scale, cfg.attn_logit_softcap)
        # which half of two-part rotary tables this layer takes (None: the whole table)
        self.local_rope: bool | None = None
        if cfg.rope_local_theta is not None:
            self.local_rope = window is not None

    def rope_half(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's rotary rows ``(..., head_dim // 2)`` of ``cos``/``sin`` (the
        global or the local half of two-part tables, else the tables as given)."""
        if self.local_rope is None:
            return cos, sin
        half = self.head_dim // 2
        part = slice(half, None) if self.local_rope else slice(0, half)
        return cos[..., part], sin[..., part]

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries ``(batch, heads, seq, head_dim)`` and keys, and values
        ``(batch, kv_heads, seq, head_dim)`` of ``x`` ``(batch, seq, dim)``."""
        b, s, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # (batch, seq, [kv_]heads·head_dim)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, -1, self.head_dim)  # (batch, seq, heads, head_dim)
        k = k.view(b, s, -1, self.head_dim)  # (batch, seq, kv_heads, head_dim)
        v = v.view(b, s, -1, self.head_dim)  # (batch, seq, kv_heads, head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rope_half(cos, sin)
        q = apply_rotary(q, cos, sin).transpose(1, 2)  # (batch, heads, seq, head_dim)
        k = apply_rotary(k, cos, sin).transpose(1, 2)  # (batch, kv_heads, seq, head_dim)
        return q, k, v.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` ``(batch, seq, dim)``, tables ``(seq, head_dim // 2)`` -> ``(batch, seq, dim)``;
        ``doc_ids`` ``(batch, seq)`` (``(batch, cp·seq)`` under cp: the whole sequence's)."""
        b, s, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        # o: (batch, heads, seq, head_dim)
        o = self.core(q, k, v) if doc_ids is None else self.core(q, k, v, doc_ids)
        o = o.transpose(1, 2).reshape(b, s, -1)  # (batch, seq, heads * head_dim)
        return self.wo(o)
