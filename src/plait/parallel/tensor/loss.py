"""Vocabulary-parallel cross-entropy (Megatron, Shoeybi et al. 2019, section 3).

The logits of a vocabulary-parallel head are ``(..., Vp/N)`` on each tp rank. The loss is
computed without ever building the full logits: the per-token max and the sum of
exponentials are all-reduced over the tp axis (AllReduce(max), AllReduce(sum)) and the
target logit comes from the rank that owns it. Backward is local: softmax minus one-hot on
this rank's columns. :func:`vocab_parallel_loss` packages it as the ``loss_fn(logits,
targets)`` that ``parallelize`` hands out when tp > 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait.comm.group import AxisGroup
from plait.mesh import Mesh
from plait.parallel.chunked_loss import IGNORE_INDEX, chunked_cross_entropy

__all__ = ["IGNORE_INDEX", "vocab_parallel_cross_entropy", "vocab_parallel_loss"]


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: AxisGroup,
    vocab_size: int,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    chunk: int = 0,
) -> torch.Tensor:
    """Cross-entropy of vocabulary-sharded logits, equal to ``F.cross_entropy`` of the
    full, unpadded logits.

    ``logits`` ``(..., Vp/N)``: this rank's columns of the padded vocabulary (rank ``r``
    holds ``[r·Vp/N, (r+1)·Vp/N)``); ``targets`` ``(...)`` the same on every tp rank.
    Columns at or beyond ``vocab_size`` are padding and are masked out. Targets equal
    to ``ignore_index`` are skipped; ``reduction`` "mean" (over the kept targets) or
    "sum". Computed in at least float32. Communication: two all-reduces over tp of
    ``tokens`` and ``2·tokens`` elements; the full logits are never built. ``chunk``
    (tokens, 0: all at once) bounds the float32 work block to ``(chunk, Vp/N)``
    (:func:`~plait.parallel.chunked_loss.chunked_cross_entropy`); the logits are saved
    by reference and the softmax is recomputed in backward.
    """
    return chunked_cross_entropy(
        logits,
        targets,
        chunk,
        group=group,
        vocab_size=vocab_size,
        ignore_index=ignore_index,
        reduction=reduction,
    )


def vocab_parallel_loss(
    mesh: Mesh, vocab_size: int, ignore_index: int = IGNORE_INDEX, chunk: int = 0
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The mean cross-entropy of vocabulary-sharded logits ``(b, s, Vp/N)`` against
    targets ``(b, s)`` over ``mesh``'s tp axis — the value ``F.cross_entropy`` gives on
    the one-device model's full logits (targets equal to ``ignore_index`` skipped),
    ``chunk`` tokens at a time (0: all at once). It takes 16-bit logits as they are
    (``takes_low_precision``): the float32 work happens chunk by chunk inside."""
    group = mesh.axis("tp")

    def make(reduction: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return vocab_parallel_cross_entropy(
                logits, targets, group, vocab_size, ignore_index, reduction, chunk
            )

        loss.takes_low_precision = True  # type: ignore[attr-defined]
        return loss

    mean = make("mean")
    mean.token_sum = make("sum")  # type: ignore[attr-defined]  # token weighting's form
    mean.ignore_index = ignore_index  # type: ignore[attr-defined]
    return mean
