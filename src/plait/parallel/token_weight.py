"""Token-weighted loss: every counted target token of the global batch weighs the same.

A step's loss (and its gradient) is ``Σ loss(token) / N`` over every target token that
counts (not ``ignore_index``) in the whole global batch: over gradient-accumulation
micro-batches, pipeline micro-batches, context-parallel shards and data ranks, ``N``
their number. The mean of per-micro-batch means (what plait did before) weighs a token
of a micro-batch with few counted targets more than one of a full micro-batch as soon as
some targets are ignored (chat loss masks, padding) — the gradient-accumulation error
``transformers`` fixed in 2024 and torchtitan in PR #2206. With no ignored target every
micro-batch counts the same number of tokens and the two agree to rounding.

How a step gets there: ``N`` is one all-reduce (sum) of one float64 count over the data
axes (dp, and cp when it has several ranks) before the forward passes; each micro-batch
then differentiates ``Σ_mb loss · D / N``, ``D`` the data axes' size, because the data
wrappers *average* gradients over those ``D`` ranks: the average of the ranks'
gradients is the gradient of ``Σ_all loss / N``. The logged loss is the same quantity
(each rank's ``Σ_rank loss · D / N``, averaged over the data ranks).

A loss takes part when it carries ``token_sum`` (``(logits, targets) -> summed loss``)
and ``ignore_index``, as plait's default losses do (:mod:`plait.parallel.loss`,
:func:`~plait.parallel.tensor.loss.vocab_parallel_loss`); any other ``loss_fn`` keeps
the mean of micro-batch means.
"""

from __future__ import annotations

import torch

from plait import comm
from plait.comm import AxisGroup
from plait.parallel.loss import LossFn
from plait.parallel.tensor.loss import IGNORE_INDEX


def sums_tokens(loss_fn: LossFn) -> bool:
    """Whether ``loss_fn`` offers the summed loss (``token_sum``) token weighting needs."""
    return getattr(loss_fn, "token_sum", None) is not None


def token_sum(loss_fn: LossFn, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss summed over the counted targets of ``targets`` (a scalar tensor)."""
    fn: LossFn = loss_fn.token_sum  # type: ignore[attr-defined]
    return fn(logits, targets)


def counted_tokens(loss_fn: LossFn, targets: torch.Tensor) -> torch.Tensor:
    """How many targets of ``targets`` count (are not ``loss_fn.ignore_index``,
    default ``IGNORE_INDEX``), int64."""
    return (targets != getattr(loss_fn, "ignore_index", IGNORE_INDEX)).sum()


def token_weight(
    loss_fn: LossFn, targets: torch.Tensor, group: AxisGroup, device: torch.device
) -> torch.Tensor | None:
    """``D / N``: the weight of one token's loss on this rank, ``N`` the counted targets
    of the global batch (``targets`` is this rank's share of it; one all-reduce of one
    float64 over ``group``, the data axes, of ``D`` ranks); None for a loss without
    ``token_sum``. A global batch without a counted target gives weight ``D`` (its
    loss is 0). The count is all-reduced whatever the loss, so that ranks whose losses
    differ in this (a rank's wrapped loss) still issue the same collectives."""
    n = counted_tokens(loss_fn, targets).to(device, torch.float64).reshape(1)
    comm.all_reduce(n, group, op="sum")  # (1,) float64: 8 bytes
    if not sums_tokens(loss_fn):
        return None
    return (group.size / n.clamp(min=1.0)).reshape(())


def weighted(summed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``summed · weight`` in ``summed``'s dtype (the tensor to differentiate)."""
    return summed * weight.to(summed.dtype)
