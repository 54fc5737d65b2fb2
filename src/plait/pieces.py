"""The local-pieces protocol: how a rank describes the parameter elements it holds.

Checkpoints are written and read in *one-device* terms: a tensor's name and shape in the
model as written for one device, and, for each rank, which elements of it that rank
holds. Every parallel wrapper describes its own part of that picture (data parallelism:
whole tensors, written by the first replica; ZeRO: flat segments of a shard; tensor
parallelism: one block along a dimension, :class:`TPSplit`; pipeline: only its stage's
tensors) through ``local_pieces()``, and the optimizer adds where each piece's fp32
master and optimizer state live. Checkpoint code reads nothing else, so it names no
parallelism.

This module sits with the mesh, below ``model`` and ``parallel``, so that both the
wrappers (which produce pieces) and checkpointing (which consumes them) can import it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class TPSplit:
    """Which tensor-parallel block of a parameter a rank holds.

    The full length ``full`` along ``dim`` is zero-padded to ``shards * block``; tp rank
    ``index`` holds block ``index // replicas`` (see ``TPShard``).
    """

    dim: int
    full: int
    shards: int
    replicas: int
    block: int
    index: int

    def local_shape(self, global_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the block a rank holds."""
        shape = list(global_shape)
        shape[self.dim] = self.block
        return tuple(shape)

    def to_json(self) -> list[int]:
        return [self.dim, self.full, self.shards, self.replicas, self.block, self.index]

    @staticmethod
    def from_json(v: list[int] | None) -> TPSplit | None:
        return None if v is None else TPSplit(*[int(x) for x in v])

    def same_block(self, other: TPSplit | None) -> bool:
        """Whether ``other`` describes the very same elements (replicas included)."""
        if other is None:
            return False
        return (self.dim, self.full, self.shards, self.block, self.index // self.replicas) == (
            other.dim,
            other.full,
            other.shards,
            other.block,
            other.index // other.replicas,
        )


def same_split(a: TPSplit | None, b: TPSplit | None) -> bool:
    """Whether two pieces' blocks hold the same elements (None: the whole tensor)."""
    if a is None or b is None:
        return a is None and b is None
    return a.same_block(b)


@dataclass
class LocalPiece:
    """A run of elements of one parameter that this rank holds.

    ``start:end`` index the flattened tensor this rank holds of parameter ``name`` (its
    tensor-parallel block when ``tp`` is set, else the whole tensor), so a ZeRO shard
    segment is a sub-range and a replicated or TP-local tensor is ``0:numel``.
    """

    name: str
    """The parameter's name in the one-device model (``layers.0.attention.wq.weight``)."""
    shape: list[int]
    """Its one-device (global) shape."""
    tp: TPSplit | None
    """The tensor-parallel block this rank holds (None: the whole tensor)."""
    start: int
    """First flat element of the piece within the local tensor."""
    end: int
    """One past its last flat element."""
    value: torch.Tensor
    """``(end - start,)`` the values: the model's own storage, or, once the optimizer has
    described the piece, its fp32 master."""
    key: torch.Tensor
    """The tensor the piece belongs to on this rank: the model parameter, or, once the
    optimizer has described it, the tensor its state is keyed by."""
    dtype: torch.dtype
    """The model's parameter dtype (the master may be wider)."""
    write: bool
    """This rank is the one replica that writes the piece."""

    def but(self, **changes: object) -> LocalPiece:
        """A copy with ``changes`` applied (pieces are refined layer by layer)."""
        return replace(self, **changes)  # type: ignore[arg-type]
