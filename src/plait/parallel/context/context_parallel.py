"""Step 2 of ``parallelize``: context parallelism over the cp axis.

Applied from outside to plait's built-in transformer (any model whose attention
modules have a replaceable ``core`` and which has a ``positions`` module):

* every attention ``core`` becomes :class:`~.ring_attention.RingAttention` (zigzag
  sequence layout) or :class:`~.ulysses_attention.UlyssesAttention` (contiguous) on
  the cp group, keeping each layer's sliding window (in global positions);
* ``model.positions`` becomes :class:`ShardPositions`, so rotary angles use the
  tokens' global positions;
* with document masking on (``model.documents.eos_id`` set), ``model.documents``
  becomes :class:`~.documents.ShardDocuments`: the whole sequence's document ids;
* :class:`ContextLayout` tells the step which tokens of each sequence this rank feeds
  (:meth:`ContextLayout.shard`).

Parameters are not sharded by cp: every cp rank holds the same weights, and the
gradient of the loss (a mean over all tokens) is the average of the cp ranks'
gradients, so data parallelism / ZeRO reduce over the combined dp x cp group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from plait.config import CP_ATTENTIONS, CPAttention
from plait.config.rules.choices import check_choice
from plait.config.rules.layout import check_cp_sequence
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.parallel.context.document_ids import ShardDocuments
from plait.parallel.context.layout import SeqLayout, local_positions, shard_sequence
from plait.parallel.context.ring_attention import RingAttention
from plait.parallel.context.ulysses_attention import UlyssesAttention


class ShardPositions(nn.Module):
    """The global positions of this cp rank's tokens (replaces ``model.positions``)."""

    def __init__(self, layout: SeqLayout, cp: int, index: int) -> None:
        super().__init__()
        self.layout: SeqLayout = layout
        self.cp = cp
        self.index = index

    def forward(self, seq: int) -> torch.Tensor:
        """``(seq,)`` int64: the global positions of the ``seq`` local tokens."""
        if self.layout == "contiguous":
            return torch.arange(self.index * seq, (self.index + 1) * seq)
        return local_positions(self.layout, self.cp, self.index, seq)


@dataclass(frozen=True)
class ContextLayout:
    """Which tokens of a sequence this cp rank holds."""

    layout: SeqLayout
    cp: int
    index: int

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of ``x`` ``(batch, seq, ...)`` -> ``(batch, seq/cp, ...)``."""
        if self.cp == 1:
            return x
        attention = "ulysses" if self.layout == "contiguous" else "ring"
        check_cp_sequence(x.shape[1], self.cp, attention)
        if self.layout == "contiguous":
            return x.chunk(self.cp, dim=1)[self.index]
        return shard_sequence(x, self.layout, self.cp, self.index, dim=1)


def apply_context_parallel(
    model: nn.Module, mesh: Mesh, attention: CPAttention = "ring"
) -> ContextLayout:
    """Replace ``model``'s attention cores and positions for the cp axis (in place)."""
    cp, index = mesh.size("cp"), mesh.index("cp")
    check_choice("parallel.cp_attention", attention, CP_ATTENTIONS)
    layout: SeqLayout = "zigzag" if attention == "ring" else "contiguous"
    owners = [m for m in model.modules() if isinstance(getattr(m, "core", None), nn.Module)]
    if not owners or not isinstance(getattr(model, "positions", None), nn.Module):
        raise ConfigError(
            f"context parallelism (cp = {cp}) replaces the attention kernels and token "
            f"positions of plait's built-in Transformer; {type(model).__name__} has no "
            "attention modules with a 'core' or no 'positions' module."
        )
    group = mesh.axis("cp")
    for m in owners:
        for what in ("scale", "softcap"):
            if getattr(m.core, what, None) is not None:
                raise ConfigError(
                    f"context parallelism (cp = {cp}) does not do the attention {what} of "
                    "this model (model.query_pre_attn_scalar / model.attn_logit_softcap, "
                    "Gemma): the ring and Ulysses kernels use 1/sqrt(head_dim) uncapped "
                    "scores; use cp = 1 (dp, tp, pp combine)."
                )
        window = getattr(m.core, "window", None)  # the layer's sliding window, kept
        core: nn.Module = (
            RingAttention(group, layout=layout, window=window)
            if attention == "ring"
            else UlyssesAttention(group, window=window)
        )
        m.core = core
    model.positions = ShardPositions(layout, cp, index)
    eos = getattr(getattr(model, "documents", None), "eos_id", None)
    if eos is not None:
        restart = bool(getattr(model.documents, "restart_positions", False))
        model.documents = ShardDocuments(eos, group, layout, restart)
    return ContextLayout(layout, cp, index)
