"""Megatron-style tensor-parallel layers (Shoeybi et al. 2019, section 3).

Each layer is built *from* the full one-device module it replaces and keeps only this
rank's shard, so every layout starts from the same weights:

* :class:`ColumnParallelLinear` — output features split: ``W (out, in)`` keeps rows
  ``[r·out/N, (r+1)·out/N)``; optionally gathers the output.
* :class:`RowParallelLinear` — input features split: ``W (out, in)`` keeps columns
  ``[r·in/N, (r+1)·in/N)``; the partial outputs are summed over the tp axis.
* :class:`VocabParallelEmbedding` — the vocabulary split: each rank looks up the tokens
  it owns, zeros for the others, and the partial embeddings are summed.
The loss on vocabulary-sharded logits is :mod:`plait.parallel.tensor.loss`.

A column-parallel layer followed by a row-parallel one needs one all-reduce in forward
(leaving the region) and one in backward (entering it). With sequence parallelism
(Korthikanti et al. 2022) those become an all-gather and a reduce-scatter; see
:mod:`plait.parallel.tensor.sequence`.

**Vocabulary padding.** A vocabulary ``V`` not divisible by N is padded to
``Vp = ceil(V/N)·N`` rows of zeros. Padded rows are never looked up (tokens are < V),
their logits are set to ``-inf`` in the loss, so the loss and every gradient equal the
unpadded model's, and the padded rows' gradients are exactly zero (AdamW leaves them 0).

Every sharded parameter carries a :class:`TPShard` (``shard_info(p)``) saying how to
gather it back (:func:`plait.parallel.tensor.sharding_plan.gather_full_state`) and how to count it
in a global gradient norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.comm.group import AxisGroup
from plait.comm.regions import gather_along, gather_from_region, scatter_to_region
from plait.errors import ConfigError
from plait.parallel.tensor.sequence import (
    SEQ_DIM,
    enter_region,
    leave_region,
    mark_sequence_parallel,
    sum_grad_over_tp,
)
from plait.pieces import LocalPiece, TPSplit

_ATTR = "plait_tp"


@dataclass(frozen=True)
class TPShard:
    """How one parameter is laid out over the tp axis.

    ``dim`` is the split dimension (None: the whole tensor on every tp rank). The full
    length ``full`` along it is zero-padded to ``shards · block``; tp rank ``r`` holds
    block ``r // replicas`` (``replicas`` > 1: key/value heads replicated on several
    ranks). ``replicas`` is also the number of tp ranks holding identical copies.
    """

    dim: int | None
    full: int
    shards: int
    replicas: int
    block: int

    @staticmethod
    def replicated(tp: int) -> TPShard:
        """The layout of a tensor held whole by each of ``tp`` ranks."""
        return TPShard(dim=None, full=0, shards=1, replicas=tp, block=0)

    @property
    def norm_weight(self) -> float:
        """Weight of this rank's squared gradient norm in a global norm summed over tp."""
        return 1.0 / self.replicas

    def shard(self, full: torch.Tensor, tp_index: int) -> torch.Tensor:
        """This rank's piece of the full (unpadded) tensor ``full``."""
        if self.dim is None:
            return full.detach().clone()
        pad = self.shards * self.block - self.full
        if pad:
            shape = list(full.shape)
            shape[self.dim] = pad
            full = torch.cat([full.detach(), full.new_zeros(shape)], dim=self.dim)
        i = tp_index // self.replicas
        return full.detach().narrow(self.dim, i * self.block, self.block).clone()

    def gather(self, local: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        """The full unpadded tensor from every rank's piece (one all-gather over tp)."""
        if self.dim is None:
            return local.detach().clone()
        out = gather_along(local.detach(), group, self.dim)  # (tp · block) along dim
        if self.replicas > 1:  # keep one copy of each replicated block
            blocks = out.split(self.block, dim=self.dim)
            out = torch.cat(blocks[:: self.replicas], dim=self.dim)
        return out.narrow(self.dim, 0, self.full).clone()


def shard_info(p: torch.Tensor) -> TPShard | None:
    """The :class:`TPShard` of a parameter placed by tensor parallelism (None otherwise)."""
    return getattr(p, _ATTR, None)


def tp_norm_weight(p: torch.Tensor) -> float:
    """Weight of ``p``'s squared gradient norm in a global norm summed over tp: 1/k for a
    tensor held identically by k tp ranks, else 1 (also for a tensor tp did not place)."""
    info = shard_info(p)
    return info.norm_weight if info is not None else 1.0


def tensor_parallel_piece(piece: LocalPiece, tp_index: int) -> LocalPiece:
    """``piece`` of a (possibly) tensor-parallel parameter in one-device terms: the
    global shape and the block this tp rank holds; only one tp rank writes a tensor held
    whole or replicated (``index % replicas == 0``)."""
    info = shard_info(piece.key)
    if info is None or info.dim is None:
        return piece.but(write=piece.write and tp_index == 0)
    split = TPSplit(info.dim, info.full, info.shards, info.replicas, info.block, tp_index)
    shape = list(piece.shape)
    shape[info.dim] = info.full
    return piece.but(tp=split, shape=shape, write=piece.write and tp_index % info.replicas == 0)


def set_shard_info(p: nn.Parameter, info: TPShard) -> nn.Parameter:
    """Attach ``info`` to ``p`` (read back with :func:`shard_info`); returns ``p``."""
    setattr(p, _ATTR, info)
    return p


def split_units(length: int, unit: int, tp: int, replicas: int, pad: bool, what: str) -> TPShard:
    """Check and describe a split of ``length`` features in whole units of ``unit``.

    ``what`` names the thing and its count in the error ("layers.0.attention.wq: 6 heads").
    Without ``pad`` the unit count must divide by the shard count ``tp / replicas``;
    raises :class:`ConfigError` with the numbers otherwise.
    """
    if length % unit:
        raise ConfigError(f"{what}: {length} features are not whole units of {unit}")
    if tp % replicas:
        raise ConfigError(f"{what}: {replicas} replicas do not divide tp={tp}")
    shards = tp // replicas
    units = length // unit
    if units % shards and not pad:
        divisors = [d for d in range(1, units + 1) if units % d == 0]
        raise ConfigError(
            f"{what} are not divisible by the tensor-parallel degree tp={shards}; "
            f"choose tp among the divisors of {units}: {divisors}"
        )
    block = math.ceil(units / shards) * unit
    return TPShard(dim=0, full=length, shards=shards, replicas=replicas, block=block)


LocalMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``(x, local weight, bias or None) -> y``: the local product of a tensor-parallel linear
(default ``F.linear``; :mod:`plait.parallel.float8` sets a float8 one)."""


class ColumnParallelLinear(nn.Module):
    """``y = x Wᵀ + b`` with the output features split over the tp axis.

    Built from the full ``linear``; keeps rows ``[i·block, (i+1)·block)`` of ``W``
    (and of ``b``) with ``i = r // replicas``. ``unit`` splits only whole groups of rows
    (an attention head's ``head_dim``); ``pad`` zero-pads the rows to a multiple of the
    shard count (the vocabulary head). ``replica_group`` (the tp ranks sharing one
    block, for key/value heads replicated when they are fewer than tp) sums the
    weight's gradient over those ranks.

    ``enter`` applies the region entrance (``f``, or the sequence all-gather) to the
    input; leave it False when the enclosing module's input already entered the region.
    Input ``(b, s, in)`` (``(b, s/N, in)`` under sequence parallelism with ``enter``);
    output ``(b, s, out/N)`` or, with ``gather_output``, ``(b, s, out)``.
    """

    local_matmul: LocalMatmul | None = None
    """The local product (None: ``F.linear``)."""

    def __init__(
        self,
        linear: nn.Linear,
        group: AxisGroup,
        *,
        enter: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        unit: int = 1,
        pad: bool = False,
        replica_group: AxisGroup | None = None,
        name: str = "linear",
    ) -> None:
        super().__init__()
        replicas = replica_group.size if replica_group is not None else 1
        self.info = split_units(linear.out_features, unit, group.size, replicas, pad, name)
        if gather_output and replicas > 1:
            raise ConfigError(f"{name}: gather_output with replicated rows is not supported")
        self.group, self.enter, self.gather_output = group, enter, gather_output
        self.sequence_parallel = sequence_parallel
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = self.info.shard(linear.weight, group.index)  # (block, in)
        self.weight = set_shard_info(nn.Parameter(w), self.info)
        self.bias: nn.Parameter | None = None
        if linear.bias is not None:
            self.bias = set_shard_info(
                nn.Parameter(self.info.shard(linear.bias, group.index)), self.info
            )
        self._hooks: list[Any] = []
        if replica_group is not None and replica_group.size > 1:
            self._hooks += [sum_grad_over_tp(p, replica_group) for p in self._own()]

    def _own(self) -> list[nn.Parameter]:
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(b, s, in)`` -> ``(b, s, out/N)`` (or ``(b, s, out)`` with gather_output)."""
        if self.enter:
            x = enter_region(x, self.group, self.sequence_parallel)  # (b, s, in)
        y = (self.local_matmul or F.linear)(x, self.weight, self.bias)  # (b, s, block)
        if self.gather_output:
            y = gather_from_region(y, self.group)  # (b, s, padded out)
            y = y.narrow(-1, 0, self.out_features)  # (b, s, out)
        return y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} (local {self.info.block}), "
            f"tp={self.group.size}, sp={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """``y = x Wᵀ + b`` with the input features split over the tp axis.

    Keeps columns ``[r·in/N, (r+1)·in/N)`` of ``W`` (whole ``unit`` groups); the bias
    is replicated and added once, after the partial products are summed (``g``, or a
    reduce-scatter along the sequence under sequence parallelism, where the bias then
    sees a sequence shard and its gradient is summed over tp). With ``exit=False`` the
    partial sums are returned (no bias allowed). Input ``(b, s, in/N)`` (or the full
    ``(b, s, in)`` when ``input_is_parallel`` is False: it is split here).
    """

    local_matmul: LocalMatmul | None = None
    """The local product (None: ``F.linear``)."""

    def __init__(
        self,
        linear: nn.Linear,
        group: AxisGroup,
        *,
        input_is_parallel: bool = True,
        exit: bool = True,
        sequence_parallel: bool = False,
        unit: int = 1,
        name: str = "linear",
    ) -> None:
        super().__init__()
        if linear.bias is not None and not exit:
            raise ConfigError(f"{name}: a bias needs the partial sums reduced (exit=True)")
        cols = split_units(linear.in_features, unit, group.size, 1, False, name)
        self.info = TPShard(dim=1, full=cols.full, shards=cols.shards, replicas=1, block=cols.block)
        self.group, self.exit = group, exit
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = self.info.shard(linear.weight, group.index)  # (out, in/N)
        self.weight = set_shard_info(nn.Parameter(w), self.info)
        self.bias: nn.Parameter | None = None
        self._hooks: list[Any] = []
        if linear.bias is not None:
            bias = nn.Parameter(linear.bias.detach().clone())
            self.bias = set_shard_info(bias, TPShard.replicated(group.size))
            if sequence_parallel and group.size > 1:
                self._hooks.append(mark_sequence_parallel(self.bias, group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(b, s, in/N)`` -> ``(b, s, out)`` (``(b, s/N, out)`` under sequence parallelism)."""
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group)  # (b, s, in/N)
        y = (self.local_matmul or F.linear)(x, self.weight, None)  # (b, s, out) partial sums
        if not self.exit:
            return y
        y = leave_region(y, self.group, self.sequence_parallel)  # (b, s or s/N, out)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features} (local {self.info.block}), out={self.out_features}, "
            f"tp={self.group.size}, sp={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows over the tp axis.

    Rank ``r`` holds rows ``[r·Vp/N, (r+1)·Vp/N)`` of the table padded to ``Vp`` rows;
    tokens outside its range look up zeros, and the partial ``(b, s, h)`` embeddings are
    summed: an all-reduce, or a reduce-scatter along the sequence under sequence
    parallelism (giving ``(b, s/N, h)``: the sequence is sharded from the first layer).
    """

    def __init__(
        self,
        embedding: nn.Embedding,
        group: AxisGroup,
        *,
        sequence_parallel: bool = False,
        name: str = "embedding",
    ) -> None:
        super().__init__()
        e = embedding
        if e.padding_idx is not None or e.max_norm is not None or e.sparse:
            raise ConfigError(f"{name}: padding_idx, max_norm and sparse are not supported")
        self.info = split_units(e.num_embeddings, 1, group.size, 1, True, name)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings, self.embedding_dim = e.num_embeddings, e.embedding_dim
        self.start = group.index * self.info.block  # first vocabulary row held here
        self.weight = set_shard_info(
            nn.Parameter(self.info.shard(e.weight, group.index)), self.info
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids ``(b, s)`` -> ``(b, s, h)`` (``(b, s/N, h)`` under sequence parallelism)."""
        local = tokens - self.start  # (b, s)
        outside = (local < 0) | (local >= self.info.block)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (b, s, h)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(out, self.group, self.sequence_parallel, SEQ_DIM)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} (padded {self.info.shards * self.info.block}, local "
            f"{self.info.block}), {self.embedding_dim}, tp={self.group.size}"
        )
