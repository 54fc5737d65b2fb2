"""The validation batches of a run, whatever the size of its validation set.

A validation set of at least one global batch is evaluated as before: each evaluation
averages ``train.eval_batches`` global batches drawn by a seeded sampler (each dp rank
its contiguous slice). A smaller one (down to one window) is evaluated whole, once per
evaluation: one global batch holding every window, filled up to ``train.global_batch``
sequences with copies of the first window whose targets are all ignored
(``IGNORE_INDEX``): the token-weighted loss (:mod:`plait.parallel.token_weight`) does
not count them, so the value is the mean over the set's tokens on any layout (dp
slices, pipeline micro-batches and cp shards keep their usual shapes).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from plait.data import BatchSampler, check_enough
from plait.data.dataset import WindowSet
from plait.data.parts import BOTH, Parts
from plait.parallel.tensor.loss import IGNORE_INDEX


class Validation:
    """This rank's validation batches: ``(inputs, targets)`` of ``global_batch / dp``
    sequences each."""

    def __init__(
        self,
        dataset: WindowSet,
        global_batch: int,
        eval_batches: int,
        dp_rank: int,
        dp: int,
        seed: int,
        parts: Parts = BOTH,
    ) -> None:
        check_enough(dataset, 1, "validation")
        self.dataset = dataset
        self.global_batch = global_batch
        self.eval_batches = eval_batches
        self.dp_rank, self.dp = dp_rank, dp
        self.parts = parts
        """What this rank reads of each batch (a pipeline stage's own halves)."""
        self.whole = len(dataset) < global_batch
        """Fewer windows than one global batch: every window, in one padded batch."""
        self.sampler = (
            None if self.whole else BatchSampler(len(dataset), global_batch, dp_rank, dp, seed)
        )

    def set_order(self, order: str) -> None:
        """Draw the batches in data order ``order`` (a resumed run's own,
        :meth:`~plait.data.sampler.BatchSampler.set_order`)."""
        if self.sampler is not None:
            self.sampler.set_order(order)

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's slice of each global batch of one evaluation, on the host."""
        if self.sampler is not None:
            for b in range(self.eval_batches):
                yield self.dataset.batch(self.sampler.rank_indices(b), self.parts)
            return
        n, per = len(self.dataset), self.global_batch // self.dp
        mine = range(self.dp_rank * per, (self.dp_rank + 1) * per)  # global positions
        x, y = self.dataset.batch([i if i < n else 0 for i in mine], self.parts)
        pad = torch.tensor([i >= n for i in mine])  # (per,) filler rows
        yield x, y.masked_fill(pad[:, None], IGNORE_INDEX)

    def describe(self) -> str:
        """The validation set and how it is evaluated, for the banner."""
        n = len(self.dataset)
        if self.whole:
            return (
                f"validation: {n:,} window(s), fewer than one global batch of "
                f"{self.global_batch}: all evaluated together (padding ignored)"
            )
        return (
            f"validation: {n:,} windows; {self.eval_batches} global batch(es) of "
            f"{self.global_batch} per evaluation"
        )
