"""Top-k sparsification with error feedback (Aji & Heafield 2017; Stich et al. 2018).

Each rank adds its error buffer to the bucket, keeps the k = ceil(rho * n) entries of
largest magnitude, and the ranks exchange ``(index, value)`` pairs with one AllGather
(indices int32 when the bucket has fewer than 2^31 elements, else int64; values in the
gradient's dtype, both packed into one byte message). Every rank then adds all ranks'
pairs into a zero bucket in rank order, so the result (the sum, i.e. the mean of the
pre-divided gradients) is identical on every rank. What a rank did not send stays in
its error buffer and is added next step.

Wire bytes per rank and bucket (AllGather output, S in :mod:`plait.comm.stats`):
``N * k * (index_bytes + value_bytes)``. With rho = 1 every entry is sent and the result
equals the plain all-reduce (up to the order of the additions).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from plait import comm
from plait.comm import AxisGroup
from plait.parallel.compression.compressor import Compressor, Finish, _done


def topk_count(numel: int, ratio: float) -> int:
    """k for a bucket of ``numel`` elements: ceil(ratio * numel), at least 1."""
    return max(1, min(numel, math.ceil(ratio * numel)))


def index_dtype(numel: int) -> torch.dtype:
    """The dtype indices travel in: int32 while they fit."""
    return torch.int32 if numel < 2**31 else torch.int64


class TopKCompressor(Compressor):
    """Send the ``ratio`` fraction of largest-magnitude entries of each bucket."""

    name = "topk"
    error_feedback = True

    def __init__(self, ratio: float, start: int = 0) -> None:
        super().__init__(start)
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio

    def reduce(
        self, key: int, flat: torch.Tensor, shapes: Sequence[torch.Size], group: AxisGroup
    ) -> Finish:
        n = flat.numel()
        k = topk_count(n, self.ratio)
        err = self.error_of(key, flat)
        corrected = flat + err  # (n,) gradient plus what earlier steps did not send
        idx = corrected.abs().topk(k, sorted=False).indices  # (k,) int64
        vals = corrected[idx]  # (k,)
        err.copy_(corrected)
        err[idx] = 0  # the unsent remainder
        if self.keep_sent:
            self._record_sent(key, corrected - err)
        ib, vb = index_dtype(n), vals.dtype
        message = torch.cat(  # (k*ib + k*vb,) bytes: indices then values
            [idx.to(ib).view(torch.uint8), vals.contiguous().view(torch.uint8)]
        )
        gathered = comm.all_gather(message, group)  # (N * message,)
        assert isinstance(gathered, torch.Tensor)
        per_rank = gathered.view(group.size, -1)  # (N, message bytes)
        split = k * torch.empty((), dtype=ib).element_size()
        flat.zero_()
        for r in range(group.size):  # rank order: the same sum on every rank
            r_idx = per_rank[r, :split].clone().view(ib).long()  # (k,) (clone: aligned)
            r_val = per_rank[r, split:].clone().view(vb)  # (k,)
            flat.index_add_(0, r_idx, r_val)  # indices unique within a rank
        return _done

    def describe(self) -> str:
        return f"{super().describe()} (ratio {self.ratio:g}, error feedback)"
