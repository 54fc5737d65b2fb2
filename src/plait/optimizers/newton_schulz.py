"""Muon's Newton-Schulz orthogonalisation and learning-rate adjustment.

Both follow ``torch.optim._muon`` (torch 2.9+) operation for operation, so that in
bfloat16 the result is bit-equal to ``torch.optim.Muon``; ``dtype`` lets the iteration
run in float32 or float64 instead (float64 makes sharded runs comparable to one process
at 1e-10).
"""

from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""torch.optim.Muon's quintic coefficients (a, b, c)."""
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
"""``optim.muon_ns_dtype`` -> torch dtype."""


def zeropower(
    g: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``(A, B)`` the approximate orthogonalisation ``U S' V^T`` of the ``(A, B)`` matrix
    ``g`` (``g = U S V^T``) by ``steps`` quintic Newton-Schulz iterations in ``dtype``,
    returned in ``dtype``."""
    if g.ndim != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {tuple(g.shape)}")
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T  # (B, A): the Gram matrix is the smaller side
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjust_lr(lr: float, how: str, shape: tuple[int, int]) -> float:
    """Muon's learning rate for an ``(A, B)`` matrix: ``lr · sqrt(max(1, A/B))``
    ('original', Keller Jordan's) or ``lr · 0.2 · sqrt(max(A, B))`` ('match_rms_adamw',
    Moonlight's: the update's RMS matches AdamW's)."""
    rows, cols = shape
    if how == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if how == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"unknown Muon lr adjustment {how!r} (original, match_rms_adamw)")
