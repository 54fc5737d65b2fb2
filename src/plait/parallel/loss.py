"""The default loss of a model prepared by :func:`~plait.parallel.parallelize.parallelize`.

At tp = 1 it is :func:`cross_entropy_loss`; at tp > 1 the logits are split over the
vocabulary and the loss is :func:`~plait.parallel.tensor.loss.vocab_parallel_loss`
(the full logits are never gathered). Either is a :data:`LossFn`. With ``chunk`` > 0
(``train.loss_chunk``) both walk the tokens ``chunk`` at a time
(:mod:`plait.parallel.chunked_loss`): the full-vocabulary float32 logits never exist.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait.parallel.chunked_loss import chunked_cross_entropy
from plait.parallel.tensor.loss import IGNORE_INDEX

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(logits, targets) -> mean loss`` (a scalar tensor). plait's losses also carry
``token_sum`` (the same signature, the loss summed over the counted targets) and
``ignore_index``: a step weighs every counted token of the global batch the same
(:mod:`plait.parallel.token_weight`)."""


def cross_entropy_loss(ignore_index: int = IGNORE_INDEX, chunk: int = 0) -> LossFn:
    """Mean cross-entropy of logits ``(..., vocab)`` against targets ``(...)``, in at
    least float32, skipping ``ignore_index`` — the default loss at tp = 1. Its
    ``token_sum`` is the same loss summed over the counted targets.

    ``chunk`` > 0: :func:`~plait.parallel.chunked_loss.chunked_cross_entropy`, which
    takes 16-bit logits as they are (``takes_low_precision``) and holds one
    ``(chunk, vocab)`` float32 block at a time; 0: ``F.cross_entropy`` on the whole."""

    def whole(reduction: str) -> LossFn:
        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            vocab = logits.shape[-1]
            return torch.nn.functional.cross_entropy(
                logits.reshape(-1, vocab),
                targets.reshape(-1),
                ignore_index=ignore_index,
                reduction=reduction,
            )

        return loss

    def chunked(reduction: str) -> LossFn:
        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return chunked_cross_entropy(
                logits, targets, chunk, ignore_index=ignore_index, reduction=reduction
            )

        loss.takes_low_precision = True  # type: ignore[attr-defined]
        return loss

    make = whole if chunk <= 0 else chunked
    return with_token_sum(make("mean"), make("sum"), ignore_index)


def with_token_sum(mean: LossFn, summed: LossFn, ignore_index: int) -> LossFn:
    """``mean`` marked with its summed form (``token_sum``) and ``ignore_index``, which
    token weighting reads (:mod:`plait.parallel.token_weight`)."""
    mean.token_sum = summed  # type: ignore[attr-defined]
    mean.ignore_index = ignore_index  # type: ignore[attr-defined]
    return mean


def loss_input(loss_fn: LossFn, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as ``loss_fn`` takes them: as they are for a loss marked
    ``takes_low_precision`` (it works in float32 chunk by chunk), else 16-bit logits
    cast to float32 (float32/float64 stay as they are)."""
    if getattr(loss_fn, "takes_low_precision", False) or logits.element_size() >= 4:
        return logits
    return logits.float()
