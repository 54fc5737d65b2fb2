"""Document ids under context parallelism: every rank gets the whole sequence's.

The model computes document ids from its tokens (:mod:`plait.model.document_mask`), but a
cp rank holds only its shard of each sequence, and a token's id counts the EOS tokens
*before* it, in other ranks' chunks too. :class:`ShardDocuments` (the model's
``documents`` module under cp) all-gathers the local end-of-document flags over the cp
axis (``batch · S/cp`` bytes per rank, uint8, counted by :mod:`plait.comm`), puts the
whole sequence back in order (:func:`~.layout.unshard_sequence`) and returns its ids
``(batch, S)``: ring attention cuts its own and each arriving block's ids out of them
by the layout, all-to-all attention masks the whole sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from plait import comm
from plait.comm import AxisGroup
from plait.parallel.context.layout import SeqLayout, unshard_sequence


class ShardDocuments(nn.Module):
    """``forward(local_tokens) -> (batch, S)`` document ids of the whole sequence."""

    def __init__(
        self, eos_id: int, group: AxisGroup, layout: SeqLayout, restart_positions: bool = False
    ) -> None:
        super().__init__()
        self.eos_id = eos_id
        self.restart_positions = restart_positions
        """Rotary positions restart at each document (global: from the whole sequence's ids)."""
        self.group = group
        self.layout: SeqLayout = layout

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` ``(batch, S/cp)``: this rank's shard -> ids ``(batch, S)`` int64."""
        eos = (tokens == self.eos_id).to(torch.uint8)  # (batch, S/cp)
        got = comm.all_gather(eos.unsqueeze(0), self.group)  # (cp, batch, S/cp)
        assert isinstance(got, torch.Tensor)
        flags = unshard_sequence(list(got.unbind(0)), self.layout, dim=1).long()  # (batch, S)
        return torch.cumsum(flags, dim=1) - flags
