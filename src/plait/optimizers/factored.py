"""Adafactor's row and column statistics of a parameter that a rank holds only a piece of.

``torch.optim.Adafactor`` keeps, for a parameter of ``n >= 2`` dimensions, the running
mean of the squared gradient along each row (``(..., R, 1)``) and each column
(``(..., 1, C)``) of its last two dimensions, and it scales the step by two whole-tensor
RMS values (the parameter's, the update's). A rank that holds a piece of the parameter
(a ZeRO flat range, a tensor-parallel block, or both) computes its piece's share of those
sums; the shares add up over the ranks holding the other pieces (one all-reduce of the
vectors, :mod:`plait.optimizers.adafactor`).

:class:`Held` says which elements a rank holds: a flat range ``[start, end)`` of its
*local* tensor (the tp block, or the whole tensor), and where that block sits in the
whole one (:class:`Split`). The statistics are kept in *whole* coordinates, padded
along a tensor-parallel split as :class:`plait.parallel.tensor.layers.TPShard` pads, so
every rank's vectors have the same length and add up by an all-reduce; padded elements
have zero gradient and weight, so they add nothing.

A flat range of a ``(B, R, C)`` tensor (``B`` the product of the leading dimensions) is
a few rectangles (:func:`runs`): a partial first row, whole rows up to a matrix
boundary, a partial last row. Every statistic and the update are computed rectangle by
rectangle, so nothing of the size of the whole tensor is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plait.comm import AxisGroup

Run = tuple[int, int, int, int, int]
"""``(r_lo, r_hi, c_lo, c_hi, offset)``: rows ``r_lo:r_hi`` of the ``(B·R, C)`` view,
columns ``c_lo:c_hi``, at ``offset`` within the piece (one row, or whole rows)."""


@dataclass(frozen=True)
class Split:
    """Where a rank's tensor-parallel block sits in the whole tensor."""

    dim: int
    """The split dimension."""
    offset: int
    """The block's first index along ``dim`` in the whole tensor."""
    padded: int
    """The whole length along ``dim``, zero-padded to ``shards · block``."""
    counts: bool
    """This rank's block is the first of its replicas: its sums count (the others add
    zeros, so a replicated block is counted once)."""


@dataclass
class Held:
    """The elements of one parameter that a rank holds (maybe none)."""

    shape: tuple[int, ...]
    """The whole (one-device) shape."""
    local: tuple[int, ...]
    """The shape of the rank's tensor (its tp block; ``shape`` without tp)."""
    start: int
    """First flat element of the piece within the local tensor."""
    end: int
    """One past its last (``start == end``: none held)."""
    split: Split | None
    """The tp block's place in the whole tensor (None: the local tensor is whole)."""
    groups: tuple[AxisGroup, ...]
    """The groups whose ranks hold the other pieces: sums are all-reduced over each."""
    key: torch.Tensor | None
    """The optimizer's tensor holding ``[start, end)`` (its state's key); None: none."""

    @property
    def factored(self) -> bool:
        """Whether Adafactor factors the second moment (two or more dimensions)."""
        return len(self.shape) >= 2

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        return math.prod(self.shape)

    @property
    def counts(self) -> bool:
        """Whether this rank's sums count (it holds elements of the first replica)."""
        return self.key is not None and (self.split is None or self.split.counts)

    def padded(self) -> tuple[int, ...]:
        """The whole shape, padded along the tp split."""
        shape = list(self.shape)
        if self.split is not None:
            shape[self.split.dim] = self.split.padded
        return tuple(shape)

    def stat_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Padded whole shapes of the row sums ``(..., R)`` and column sums ``(..., C)``."""
        p = self.padded()
        return p[:-1], p[:-2] + p[-1:]

    def stat_numel(self) -> int:
        """Elements this parameter adds to the all-reduced statistics of one step: the row
        and column sums (factored) and the parameter's and the update's squared norms."""
        if not self.factored:
            return 2
        rows, cols = self.stat_shapes()
        return math.prod(rows) + math.prod(cols) + 2


def runs(start: int, end: int, rows: int, cols: int) -> list[Run]:
    """The rectangles of flat elements ``[start, end)`` of a stack of ``(rows, cols)``
    matrices, each within one matrix (see the module docstring)."""
    out: list[Run] = []
    k = start
    while k < end:
        r, c = divmod(k, cols)
        if c > 0 or end - k < cols:  # a partial row
            c_hi = min(cols, c + end - k)
            out.append((r, r + 1, c, c_hi, k - start))
            k += c_hi - c
        else:  # whole rows, up to the end of the range or of the matrix
            r_hi = min(r + (end - k) // cols, (r // rows + 1) * rows)
            out.append((r, r_hi, 0, cols, k - start))
            k += (r_hi - r) * cols
    return out


def _dims(h: Held) -> tuple[int, int]:
    """``(R, C)`` of the local tensor's matrices."""
    return h.local[-2], h.local[-1]


def _split_dims(h: Held) -> tuple[int | None, int | None]:
    """The split dimension in the row-sum and the column-sum tensors (None: not split)."""
    if h.split is None:
        return None, None
    d, n = h.split.dim, len(h.shape)
    if d < n - 2:
        return d, d
    return (d, None) if d == n - 2 else (None, n - 2)


def _place(local: torch.Tensor, whole: tuple[int, ...], dim: int | None, off: int) -> torch.Tensor:
    """``local`` at offset ``off`` along ``dim`` of zeros shaped ``whole`` (dim None: the
    same coordinates)."""
    if dim is None:
        return local
    out = local.new_zeros(whole)
    out.narrow(dim, off, local.shape[dim]).copy_(local)
    return out


def _take(whole: torch.Tensor, local: tuple[int, ...], dim: int | None, off: int) -> torch.Tensor:
    """The block of ``whole`` (padded coordinates) a rank's local tensor covers."""
    if dim is None:
        return whole
    return whole.narrow(dim, off, local[dim])


def partial_sums(h: Held, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shares of the row and column sums of ``grad²`` (the piece's gradient,
    flat), in padded whole coordinates (flat)."""
    rows_n, cols_n = _dims(h)
    lead = h.local[:-2]
    row_sum = grad.new_zeros((*lead, rows_n))
    col_sum = grad.new_zeros((*lead, cols_n))
    rf, cf = row_sum.view(-1), col_sum.view(-1, cols_n)
    for r_lo, r_hi, c_lo, c_hi, off in runs(h.start, h.end, rows_n, cols_n):
        block = grad[off : off + (r_hi - r_lo) * (c_hi - c_lo)].view(r_hi - r_lo, c_hi - c_lo)
        sq = block.square()
        rf[r_lo:r_hi] += sq.sum(1)
        cf[r_lo // rows_n, c_lo:c_hi] += sq.sum(0)
    rd, cd = _split_dims(h)
    off = h.split.offset if h.split is not None else 0
    rows_w, cols_w = h.stat_shapes()
    return (
        _place(row_sum, rows_w, rd, off).reshape(-1),
        _place(col_sum, cols_w, cd, off).reshape(-1),
    )


def whole_means(
    h: Held, row_sum: torch.Tensor, col_sum: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The row means ``(..., R, 1)`` and column means ``(..., 1, C)`` of ``grad²`` over
    the whole parameter (torch.optim.Adafactor's ``row_mean``, ``col_mean``), from the
    all-reduced padded sums."""
    rows_w, cols_w = h.stat_shapes()
    rows, cols = row_sum.view(rows_w), col_sum.view(cols_w)
    if h.split is not None:  # drop the padding along the split
        rd, cd = _split_dims(h)
        full = h.shape[h.split.dim]
        rows = rows.narrow(rd, 0, full) if rd is not None else rows
        cols = cols.narrow(cd, 0, full) if cd is not None else cols
    return rows.unsqueeze(-1) / h.shape[-1], cols.unsqueeze(-2) / h.shape[-2]


def piece_update(
    h: Held, grad: torch.Tensor, row_var: torch.Tensor, col_var: torch.Tensor, eps1: float
) -> torch.Tensor:
    """The piece of torch.optim.Adafactor's update ``grad / sqrt(clamp(V, eps1²))`` with
    ``V = (row_var @ col_var) / clamp(mean(row_var), eps1)``, from the whole
    ``row_var (..., R, 1)`` and ``col_var (..., 1, C)``; flat like ``grad``."""
    mean = row_var.mean(dim=-2, keepdim=True)  # (..., 1, 1), clamped below
    rd, cd = _split_dims(h)
    off = h.split.offset if h.split is not None else 0
    rows_n, cols_n = _dims(h)
    lead = h.local[:-2]
    rv, cv, mv = row_var.squeeze(-1), col_var.squeeze(-2), mean.reshape(mean.shape[:-2])
    if h.split is not None:  # pad to the padded whole shape, then take the local block
        rv, cv = _pad(rv, rd, h.split.padded), _pad(cv, cd, h.split.padded)
        if h.split.dim < len(h.shape) - 2:
            mv = _pad(mv, h.split.dim, h.split.padded)
    rv = _take(rv, (*lead, rows_n), rd, off).reshape(-1)
    cv = _take(cv, (*lead, cols_n), cd, off).reshape(-1, cols_n)
    if h.split is not None and h.split.dim < len(h.shape) - 2:
        mv = _take(mv, lead, h.split.dim, off)
    mv = mv.reshape(-1).clamp(min=eps1)  # padded matrices: eps1, not 0
    out = torch.empty_like(grad)
    for r_lo, r_hi, c_lo, c_hi, off_k in runs(h.start, h.end, rows_n, cols_n):
        n = (r_hi - r_lo) * (c_hi - c_lo)
        b = r_lo // rows_n
        var = rv[r_lo:r_hi, None] * cv[b, None, c_lo:c_hi]  # (rows, cols) of row_var @ col_var
        var = var.div_(mv[b]).clamp_(min=eps1 * eps1).rsqrt_()
        block = grad[off_k : off_k + n].view(r_hi - r_lo, c_hi - c_lo)
        out[off_k : off_k + n].view(r_hi - r_lo, c_hi - c_lo).copy_(var.mul_(block))
    return out


def _pad(t: torch.Tensor, dim: int | None, length: int) -> torch.Tensor:
    """``t`` zero-padded to ``length`` along ``dim`` (None or long enough: itself)."""
    if dim is None or t.shape[dim] >= length:
        return t
    shape = list(t.shape)
    shape[dim] = length - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)
