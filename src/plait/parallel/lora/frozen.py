"""The frozen parameters of a model as checkpoint pieces.

The data wrappers describe the parameters they reduce and shard (the trainable ones);
a frozen parameter (LoRA's base) is held whole by every rank of the data group, its
tensor-parallel block or pipeline stage only. :func:`frozen_pieces` describes those, so
that a checkpoint holds the base beside the adapters (a resume needs nothing else) and
a start from ``train.init_from`` fills the base as it fills every other weight.
"""

from __future__ import annotations

from torch import nn

from plait.pieces import LocalPiece


def frozen_pieces(module: nn.Module, writer: bool) -> list[LocalPiece]:
    """Every frozen parameter of ``module`` whole (named as in ``module``; the caller
    renames), written by this rank when ``writer`` (the first rank of the data group)."""
    out: list[LocalPiece] = []
    seen: set[int] = set()
    for name, p in module.named_parameters():
        if p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        flat = p.detach().reshape(-1)  # (numel,) a view of the parameter
        out.append(LocalPiece(name, list(p.shape), None, 0, p.numel(), flat, p, p.dtype, writer))
    return out
