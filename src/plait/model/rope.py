"""Rotary position embeddings (RoPE): the frequency tables, their scalings, and the
rotation of queries and keys.

Pair ``j`` of a head is channels ``j`` and ``j + head_dim/2`` (Hugging Face's
``rotate_half`` convention). Scalings: 'linear' and Llama 3.1's 'llama3' as Hugging
Face computes them; the others (``yarn``, ``longrope``, ``dynamic``) and a partial
rotary factor are refused by the family specs (:mod:`plait.arch.families`).
"""

from __future__ import annotations

import math

import torch

from plait.config import ModelConfig


def scale_rope(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """``inv_freq`` ``(head_dim // 2,)`` float64 with ``cfg.rope_scaling`` applied, as
    Hugging Face's ``linear`` and ``llama3`` rope types compute it."""
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_scaling != "llama3":
        return inv_freq
    old, low, high = (
        cfg.rope_original_max_seq_len,
        cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor,
    )
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / cfg.rope_factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, cfg: ModelConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos/sin tables, each ``(max_seq_len, head_dim // 2)`` float32 on the CPU.

    Pair ``j`` of a head (channels ``j`` and ``j + head_dim/2``) rotates at frequency
    ``theta ** (-2j / head_dim)`` (scaled by ``cfg``'s ``rope_scaling``, if given,
    :func:`scale_rope`); the angles are computed in float64.
    """
    f64, cpu = torch.float64, torch.device("cpu")
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=f64, device=cpu) / head_dim)
    if cfg is not None:
        inv_freq = scale_rope(inv_freq, cfg)
    pos = torch.arange(max_seq_len, dtype=f64, device=cpu)
    angles = torch.outer(pos, inv_freq)  # (max_seq_len, head_dim // 2)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(batch, seq, heads, head_dim)`` by positions.

    ``cos`` and ``sin`` are ``(seq, head_dim // 2)``: row ``t`` holds the angles of the
    position of ``x[:, t]`` (or ``(batch, seq, head_dim // 2)``: positions per row).
    Channels ``j`` and ``j + head_dim/2`` form a rotated pair.
    """
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)  # (batch, seq, heads, head_dim // 2) each
    # (1 or batch, seq, 1, head_dim // 2); (batch, seq, half) tables: per-row positions
    c = (cos[:, :, None, :] if cos.dim() == 3 else cos[None, :, None, :]).float()
    s = (sin[:, :, None, :] if sin.dim() == 3 else sin[None, :, None, :]).float()
    out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return out.type_as(x)


def rope_width(cfg: ModelConfig) -> int:
    """Columns of the model's rotary tables: ``head_dim // 2``, twice that with
    ``rope_local_theta`` (global layers' angles, then the sliding layers')."""
    half = cfg.head_dim // 2
    return half if cfg.rope_local_theta is None else 2 * half


def model_rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's cos/sin tables ``(max_seq_len, rope_width(cfg))``: ``rope_theta`` with
    ``rope_scaling``, and with ``rope_local_theta`` (Gemma 3) the unscaled local tables
    concatenated after them (each attention takes its half,
    :meth:`~plait.model.attention.Attention.rope_half`)."""
    cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg)
    if cfg.rope_local_theta is None:
        return cos, sin
    lcos, lsin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_local_theta)
    return torch.cat((cos, lcos), dim=-1), torch.cat((sin, lsin), dim=-1)
