"""The normalisations of the built-in transformer: RMSNorm over the model width, and the
query/key norms of Qwen3 (per head) and OLMo 2 (over a whole projection).

:class:`ProjectionRMSNorm` normalises a projection's whole output; under tensor
parallelism a rank holds only some heads of it, so the sum of squares is all-reduced
over tp (:func:`plait.comm.regions.reduce_from_region` after
:func:`~plait.comm.regions.copy_to_region`: an all-reduce forward and backward, counted
on the tp axis; ``(batch, seq, 1)`` values per call). The tensor-parallel plan names it
with the style ``colwise_norm`` (:mod:`plait.parallel.tensor.sharding_plan`).
"""

from __future__ import annotations

import torch
from torch import nn

from plait.comm.group import AxisGroup
from plait.comm.regions import copy_to_region, reduce_from_region


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned per-channel gain (no bias).

    ``unit_offset`` (Gemma): the gain is ``1 + weight`` (the weight starts at zero) and
    the product is taken in float32 before the cast back, as transformers' Gemma norm."""

    def __init__(self, dim: int, eps: float = 1e-5, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(dim))  # (dim,)

    def reset_parameters(self) -> None:
        """Set the gain to one (the weight to ones, or zeros with ``unit_offset``)."""
        with torch.no_grad():
            self.weight.fill_(0.0 if self.unit_offset else 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x`` (any leading shape), in float32."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.gain(x, y)

    def gain(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The normalised float32 ``y`` times the gain, in ``x``'s dtype."""
        if self.unit_offset:
            return (y * (1.0 + self.weight.float())).type_as(x)
        return y.type_as(x) * self.weight


class ProjectionRMSNorm(RMSNorm):
    """RMSNorm over a whole projection ``(batch, seq, heads · head_dim)`` (OLMo 2's q/k
    norm). On one device it is :class:`RMSNorm`; tensor parallelism sets ``group`` (the
    tp axis), ``width`` (the whole projection's width) and ``replicas`` (tp ranks that
    hold the same key/value heads): the local sums of squares are then summed over
    ``group`` and divided by ``replicas`` before the mean over ``width``. On one device
    and under tp alike they are accumulated in float64 and the mean rounded to float32
    (transformers takes a float32 mean: the same to a float32 rounding), so the ranks'
    other order of summation rarely moves the float32 result."""

    def __init__(self, dim: int, eps: float = 1e-5, unit_offset: bool = False) -> None:
        super().__init__(dim, eps, unit_offset)
        self.width = dim
        self.replicas = 1
        self.group: AxisGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, local width)`` normalised by the whole projection's RMS."""
        xf = x.float()
        ss = x.double().pow(2).sum(-1, keepdim=True)  # (batch, seq, 1) this rank's part
        if self.group is not None:
            ss = reduce_from_region(copy_to_region(ss, self.group), self.group) / self.replicas
        y = xf * torch.rsqrt((ss / self.width).float() + self.eps)
        return self.gain(x, y)
