"""Megatron sequence parallelism (Korthikanti et al. 2022, section 4.2).

Tensor parallelism alone (Shoeybi et al. 2019) leaves the parts of a block *between*
its tensor-parallel regions — the norms, the residual additions, dropout — replicated:
every tp rank holds and saves the whole ``(batch, seq, hidden)`` activation there.
Sequence parallelism shards those parts along the sequence instead:

* entering a tensor-parallel region (before the column-parallel projections), the
  sequence shards are all-gathered: ``(b, s/N, h) -> (b, s, h)``; backward
  reduce-scatters the gradient (Megatron's ``g``-bar);
* leaving it (after the row-parallel projection), the partial sums are reduce-scattered
  along the sequence instead of all-reduced: ``(b, s, h) -> (b, s/N, h)``; backward
  all-gathers (``f``-bar).

An all-gather plus a reduce-scatter move the bytes of one all-reduce, so the traffic is
unchanged while the activations of the norm/residual regions shrink by N. A parameter
used inside a sequence-sharded region (a norm gain, a row-parallel bias) sees only part
of the sequence on each rank, so its gradient is summed over the tp axis
(:func:`mark_sequence_parallel`) before the data-parallel / ZeRO reduction sees it.

The functions here choose between the plain tensor-parallel operators and their
sequence-parallel pair, so layers take one ``sequence_parallel`` flag.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.comm.group import AxisGroup
from plait.comm.regions import (
    copy_to_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    sum_grad_over,
)
from plait.errors import ConfigError

SEQ_DIM = 1
"""The sequence dimension of plait's activations ``(batch, seq, hidden)``."""


def enter_region(
    x: torch.Tensor, group: AxisGroup, sequence_parallel: bool, seq_dim: int = SEQ_DIM
) -> torch.Tensor:
    """Enter a tensor-parallel region.

    Without sequence parallelism ``x`` is ``(b, s, h)`` on every rank: Megatron's ``f``
    (identity; gradient all-reduced). With it ``x`` is ``(b, s/N, h)`` and is
    all-gathered to ``(b, s, h)`` (gradient reduce-scattered).
    """
    if sequence_parallel:
        return gather_from_sequence(x, group, seq_dim)
    return copy_to_region(x, group)


def leave_region(
    x: torch.Tensor, group: AxisGroup, sequence_parallel: bool, seq_dim: int = SEQ_DIM
) -> torch.Tensor:
    """Leave a tensor-parallel region: sum the ranks' partial ``(b, s, h)`` outputs.

    Without sequence parallelism: Megatron's ``g`` (all-reduce; the result is
    ``(b, s, h)`` on every rank). With it: a reduce-scatter along the sequence, giving
    this rank's ``(b, s/N, h)`` shard.
    """
    if sequence_parallel:
        return reduce_scatter_to_sequence(x, group, seq_dim)
    return reduce_from_region(x, group)


_GRAD_SUMS = "plait_grad_sums"


def sum_grad_over_tp(param: torch.Tensor, group: AxisGroup) -> Any:
    """:func:`~plait.comm.regions.sum_grad_over` that also works on a meta parameter:
    the group is remembered on ``param`` and the hook registered now when ``param`` has
    storage, else by :func:`register_grad_sums` once ``parallelize`` has given it
    storage (a tensor's hooks do not survive that swap). Returns the handle or None."""
    param.__dict__.setdefault(_GRAD_SUMS, []).append(group)
    return None if param.is_meta else sum_grad_over(param, group)


def grad_sum_groups(param: torch.Tensor) -> list[AxisGroup]:
    """The groups :func:`sum_grad_over_tp` sums ``param``'s gradient over."""
    return list(param.__dict__.get(_GRAD_SUMS, []))


def register_grad_sums(param: torch.Tensor) -> None:
    """Register again the gradient sums :func:`sum_grad_over_tp` remembered on
    ``param`` (after it was given storage)."""
    for group in param.__dict__.get(_GRAD_SUMS, []):
        sum_grad_over(param, group)


def mark_sequence_parallel(param: torch.Tensor, group: AxisGroup) -> Any:
    """Sum ``param``'s gradient over ``group`` in every backward pass (returns the hook
    handle; None for a meta parameter, see :func:`sum_grad_over_tp`). For the norm gains
    (and biases added to sequence shards) under sequence parallelism: each rank's
    gradient covers only its part of the sequence."""
    return sum_grad_over_tp(param, group)


def check_sequence_length(seq_len: int, tp: int) -> None:
    """Refuse a sequence length that the tp ranks cannot split evenly (:class:`ConfigError`)."""
    if tp > 1 and seq_len % tp:
        lo = max(tp, seq_len // tp * tp)
        raise ConfigError(
            f"sequence parallelism splits the sequence over tp={tp} ranks, but the sequence "
            f"length {seq_len} is not divisible by {tp}; use a multiple of {tp} "
            f"(e.g. {lo} or {lo + tp}) or turn sequence parallelism off."
        )
