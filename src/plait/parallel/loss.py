"""The default loss of a model prepared by :func:`~plait.parallel.parallelize.parallelize`.

At tp = 1 it is :func:`cross_entropy_loss`; at tp > 1 the logits are split over the
vocabulary and the loss is :func:`~plait.parallel.tensor.loss.vocab_parallel_loss`
(the full logits are never gathered). Either is a :data:`LossFn`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait.parallel.tensor.loss import IGNORE_INDEX

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(logits, targets) -> mean loss`` (a scalar tensor)."""


def cross_entropy_loss(ignore_index: int = IGNORE_INDEX) -> LossFn:
    """Mean cross-entropy of logits ``(..., vocab)`` against targets ``(...)``, in at
    least float32, skipping ``ignore_index`` — the default loss at tp = 1."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        vocab = logits.shape[-1]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=ignore_index
        )

    return loss
