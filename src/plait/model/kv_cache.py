"""A key/value cache and the built-in transformer's forward over it, for generation.

Generating token ``t`` needs the keys and values of tokens ``0 .. t-1`` at every layer;
recomputing them costs a forward over the whole prefix per new token. :class:`KVCache`
keeps them, per layer, in buffers ``(batch, kv_heads, max_len, head_dim)`` allocated on
first use (so a tensor-parallel rank, which holds only its key/value heads, caches only
those), and :func:`forward_cached` runs the blocks of a
:class:`~plait.model.transformer.Transformer` on the *new* tokens only: it rotates their
queries and keys at their absolute positions ``start .. start + t - 1`` (the RoPE table
rows), appends the keys and values to the cache and lets the new queries attend to every
cached position (causally within the new tokens). The model's own modules compute
everything else (norms, projections, MLP, head), so a model whose projections a wrapper
replaced (tensor parallelism: whole heads per rank, the output projection's partial sums
all-reduced) decodes unchanged. Grouped-query attention: each key/value head serves
``heads / kv_heads`` query heads, as in the model's own attention.

The forward here does not use ``model.positions`` nor the attention ``core``: a context-
parallel wrapper that replaced those (they span the cp ranks) leaves it unaffected, since
every cp rank holds the whole model.

A block's modules are run through its methods (``attend``, ``feed``), not its
``forward``, so hooks on the block itself do not fire; ``scope`` (a context manager per
block, e.g. ZeRO-3's :class:`~plait.parallel.zero.unit_by_unit.UnitByUnit`, which
gathers the block's parameters and frees them after) is entered around each block's work.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import ConfigError
from plait.model.transformer import Attention, Block, Transformer, cap_logits, embed

BlockScope = Callable[[nn.Module], contextlib.AbstractContextManager[object]]
"""A context manager entered around one block's work in the cached forward."""


class KVCache:
    """Keys and values of the tokens seen so far, per layer, for batch rows decoded
    together. ``length`` tokens are cached; :meth:`update` returns a layer's keys and
    values including the new ones; :meth:`advance` moves ``length`` on once every layer
    has been updated."""

    def __init__(self, n_layers: int, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self._k: list[torch.Tensor | None] = [None] * n_layers  # (b, kv_heads, max_len, hd)
        self._v: list[torch.Tensor | None] = [None] * n_layers

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` ``(batch, kv_heads, t, head_dim)`` at positions
        ``length .. length + t - 1`` of ``layer``; returns that layer's keys and values of
        positions ``0 .. length + t - 1``, each ``(batch, kv_heads, length + t, head_dim)``."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ConfigError(
                f"the key/value cache holds {self.max_len} positions; {end} were asked for."
            )
        kb, vb = self._k[layer], self._v[layer]
        if kb is None or vb is None:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            kb = self._k[layer] = k.new_empty(shape)
            vb = self._v[layer] = v.new_empty(shape)
        kb[:, :, self.length : end] = k
        vb[:, :, self.length : end] = v
        return kb[:, :, :end], vb[:, :, :end]

    def advance(self, t: int) -> None:
        """``t`` more tokens are cached in every layer."""
        self.length += t

    def nbytes(self) -> int:
        """Bytes of the allocated buffers."""
        return sum(b.numel() * b.element_size() for b in (*self._k, *self._v) if b is not None)


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the new queries ``q`` ``(batch, heads, t, head_dim)`` at positions
    ``start .. start + t - 1`` over the cached ``k``/``v`` ``(batch, kv_heads, start + t,
    head_dim)``: query ``i`` sees positions ``0 .. start + i`` (only the last ``window``
    of them with a sliding window); ``scale`` and ``softcap`` as the model's core's.
    Returns ``(batch, heads, t, head_dim)``."""
    t, total = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # GQA: key/value head j serves query heads j·groups .. (j+1)·groups - 1
        k = k.repeat_interleave(groups, dim=1)  # (batch, heads, total, head_dim)
        v = v.repeat_interleave(groups, dim=1)
    unbounded = window is None or window >= total
    if t == 1 and unbounded and softcap is None:  # one new token sees every position
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    if start == 0 and unbounded and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    pos = torch.arange(total, device=q.device)[None, :]
    q_pos = (start + torch.arange(t, device=q.device))[:, None]
    mask = pos <= q_pos  # (t, total)
    if window is not None:
        mask = mask & (q_pos - pos < window)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = torch.matmul(q, k.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    s = (torch.tanh(s / softcap) * softcap).masked_fill(~mask, float("-inf"))  # (b, h, t, total)
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _attention(
    attn: Attention,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: KVCache,
    layer: int,
) -> torch.Tensor:
    """The block's attention on the new tokens ``x`` ``(batch, t, dim)`` with the cache."""
    b, t, _ = x.shape
    q, k, v = attn.qkv(x, cos, sin)  # (batch, [kv_]heads, t, head_dim): the model's own
    start = cache.length
    k_all, v_all = cache.update(layer, k, v)  # (batch, kv, start+t, hd)
    window = getattr(attn.core, "window", None)  # the layer's sliding window
    scale, cap = getattr(attn.core, "scale", None), getattr(attn.core, "softcap", None)
    o = cached_attention(q, k_all, v_all, start, window, scale, cap)  # (b, heads, t, hd)
    return attn.wo(o.transpose(1, 2).reshape(b, t, -1))  # (batch, t, dim)


def forward_cached(
    model: Transformer, tokens: torch.Tensor, cache: KVCache, scope: BlockScope | None = None
) -> torch.Tensor:
    """Run ``model`` on the new ``tokens`` ``(batch, t)``, the ones after the ``cache``'s
    ``length``; returns the logits of the last new token ``(batch, vocab)`` (a vocabulary
    shard when a wrapper split the head) and leaves the new keys/values in ``cache``.
    ``scope``: entered around each block's work (see the module docstring)."""
    start, t = cache.length, tokens.shape[1]
    limit = model.cfg.max_seq_len
    if start + t > limit:
        raise ConfigError(
            f"generation reached position {start + t} but the model's rotary tables end at "
            f"model.max_seq_len = {limit}; ask for fewer new tokens or a shorter prompt."
        )
    cos = model.rope_cos[start : start + t]  # (t, head_dim // 2)
    sin = model.rope_sin[start : start + t]
    h = embed(model.tok_embeddings, tokens, model.cfg)  # (batch, t, dim)
    for i, layer in enumerate(model.layers):
        block = cast(Block, layer)  # its modules may be parallel versions (same names)
        attn = block.attention
        attend = functools.partial(_attention, attn, cos=cos, sin=sin, cache=cache, layer=i)
        with scope(block) if scope is not None else contextlib.nullcontext():
            h = block.feed(block.attend(h, attend))
    cache.advance(t)
    last = model.norm(h[:, -1:])  # (batch, 1, dim)
    return cap_logits(model.output(last), model.cfg)[:, 0]  # (batch, vocab)
