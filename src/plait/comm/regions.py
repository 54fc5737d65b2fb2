"""Differentiable collectives for tensor and sequence parallelism (``autograd.Function``).

Shoeybi et al. 2019 ("Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism", section 3) split a transformer block into *tensor-parallel regions*
bounded by two conjugate operators:

* ``f`` — :func:`copy_to_region`: identity in forward, all-reduce of the gradient in
  backward. It enters a region whose input every rank holds whole (each rank's
  computation contributes part of the input's gradient).
* ``g`` — :func:`reduce_from_region`: all-reduce in forward, identity in backward. It
  leaves a region whose ranks each hold a partial sum of the output.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", section 4.2) keep the regions between blocks (norms, residuals, dropout)
sharded along the *sequence*; ``f`` and ``g`` then become the pair

* ``g``-bar — :func:`gather_from_sequence`: all-gather along the sequence in forward,
  reduce-scatter in backward (enters a tensor-parallel region);
* ``f``-bar — :func:`reduce_scatter_to_sequence`: reduce-scatter along the sequence in
  forward, all-gather in backward (leaves it).

An all-reduce moves ``2(N-1)/N·S`` bus bytes; an all-gather plus a reduce-scatter of the
same full tensor move ``(N-1)/N·S`` each: the same bytes, while the activations between
regions take ``1/N`` of the memory.

Also here: gathering / splitting along the last (feature) dimension, used by a
column-parallel layer that returns its whole output, and :func:`sum_grad_over`, a
gradient hook for parameters whose per-rank gradient is a partial sum.

plait's collectives concatenate and scatter along dim 0; the functions below move the
dimension they work on to the front (``movedim`` + ``contiguous``) and back. Every call
goes through :mod:`plait.comm.ops` and is counted on the group's axis.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from plait.comm.group import AxisGroup
from plait.comm.ops import all_gather, all_reduce, reduce_scatter
from plait.errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])


def _eager(fn: F) -> F:
    """Run a region boundary eagerly under ``torch.compile`` (a graph break: a collective
    counted in Python cannot be traced; see docs/compile.md).

    The same as ``torch.compiler.disable`` but without importing ``torch._dynamo`` (about
    1 s of every process's start-up) unless something is being compiled: outside
    compilation ``fn`` runs directly; under it dynamo meets ``torch._disable_dynamo``'s
    wrapper, which it skips (the graph break), and that wrapper runs ``fn`` with dynamo off.
    """
    skipped = torch._disable_dynamo(fn)

    @functools.wraps(fn)
    def boundary(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return skipped(*args, **kwargs)
        return fn(*args, **kwargs)

    return boundary  # type: ignore[return-value]


# ---------------------------------------------------------------- plain helpers


def _all_reduce(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Sum of ``x`` over the group, in a fresh contiguous tensor."""
    out = x.contiguous().clone() if g.size > 1 else x.view_as(x)
    all_reduce(out, g, op="sum")
    return out


def _check_divisible(length: int, g: AxisGroup, what: str) -> None:
    if length % g.size:
        below, above = length // g.size * g.size, (length // g.size + 1) * g.size
        fits = f"{below} or {above}" if below else f"{above}"
        raise ConfigError(
            f"{what} of length {length} cannot be split over the {g.size} ranks of mesh axis "
            f"'{g.name}': it must be a multiple of {g.size} (e.g. {fits})"
        )


def split_along(x: torch.Tensor, g: AxisGroup, dim: int, what: str = "dimension") -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (no communication)."""
    _check_divisible(x.shape[dim], g, what)
    n = x.shape[dim] // g.size
    return x.narrow(dim, g.index * n, n).contiguous()


def gather_along(x: torch.Tensor, g: AxisGroup, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in axis order (one all-gather)."""
    if g.size == 1:
        all_gather(x, g)  # counted no-op: keeps call counts layout-independent
        return x.view_as(x)
    front = x.movedim(dim, 0).contiguous()  # (local, ...) with ``dim`` moved first
    out = all_gather(front, g)  # (size * local, ...)
    assert isinstance(out, torch.Tensor)
    return out.movedim(0, dim).contiguous()


def reduce_scatter_along(
    x: torch.Tensor, g: AxisGroup, dim: int, what: str = "dimension"
) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim`` (one reduce-scatter)."""
    _check_divisible(x.shape[dim], g, what)
    if g.size == 1:
        reduce_scatter(x, g)  # counted no-op
        return x.view_as(x)
    front = x.movedim(dim, 0).contiguous()  # (full, ...) with ``dim`` moved first
    out = reduce_scatter(front, g, op="sum")  # (full / size, ...)
    assert isinstance(out, torch.Tensor)
    return out.movedim(0, dim).contiguous()


# ---------------------------------------------------------------- f and g


class _CopyToRegion(torch.autograd.Function):
    """``f``: identity forward, all-reduce (sum) backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
        ctx.group = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """``g``: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
        return _all_reduce(x, g)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@_eager
def copy_to_region(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Megatron's ``f``: ``x`` unchanged; its gradient summed over ``g`` in backward."""
    return _CopyToRegion.apply(x, g)


@_eager
def reduce_from_region(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Megatron's ``g``: the sum of every rank's ``x``; the gradient passes unchanged."""
    return _ReduceFromRegion.apply(x, g)


# ---------------------------------------------------------------- last (feature) dim


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's chunk backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
        ctx.group = g
        return gather_along(x, g, x.dim() - 1)  # (..., local) -> (..., size * local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return split_along(grad, ctx.group, grad.dim() - 1), None


class _ScatterLastDim(torch.autograd.Function):
    """Keep this rank's chunk of the last dim forward; all-gather it backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
        ctx.group = g
        return split_along(x, g, x.dim() - 1, "the last dimension")  # (..., full / size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather_along(grad, ctx.group, grad.dim() - 1), None


@_eager
def gather_from_region(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """``(..., local)`` -> ``(..., size·local)``: every rank's features, in axis order."""
    return _GatherLastDim.apply(x, g)


@_eager
def scatter_to_region(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """``(..., full)`` -> ``(..., full/size)``: this rank's features; gathered in backward."""
    return _ScatterLastDim.apply(x, g)


# ---------------------------------------------------------------- sequence dim


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence forward; reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = g, dim
        return gather_along(x, g, dim)  # (b, s/N, h) -> (b, s, h) for dim 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return reduce_scatter_along(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = g, dim
        return reduce_scatter_along(x, g, dim, "the sequence")  # (b, s, h) -> (b, s/N, h)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return gather_along(grad, ctx.group, ctx.dim), None, None


class _ScatterSequence(torch.autograd.Function):
    """Keep this rank's sequence chunk forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = g, dim
        return split_along(x, g, dim, "the sequence")  # (b, s, h) -> (b, s/N, h)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return gather_along(grad, ctx.group, ctx.dim), None, None


@_eager
def gather_from_sequence(x: torch.Tensor, g: AxisGroup, dim: int = 1) -> torch.Tensor:
    """Enter a TP region under sequence parallelism: ``(b, s/N, h)`` -> ``(b, s, h)``.

    Backward reduce-scatters the gradient (each rank's region computed a partial one).
    """
    return _GatherSequence.apply(x, g, dim)


@_eager
def reduce_scatter_to_sequence(x: torch.Tensor, g: AxisGroup, dim: int = 1) -> torch.Tensor:
    """Leave a TP region under sequence parallelism: partial ``(b, s, h)`` -> summed
    ``(b, s/N, h)``. Backward all-gathers the gradient."""
    return _ReduceScatterSequence.apply(x, g, dim)


@_eager
def scatter_to_sequence(x: torch.Tensor, g: AxisGroup, dim: int = 1) -> torch.Tensor:
    """Shard a replicated ``(b, s, h)`` along the sequence (no forward communication);
    backward all-gathers the gradient."""
    return _ScatterSequence.apply(x, g, dim)


# ---------------------------------------------------------------- parameter gradients


def sum_grad_over(param: torch.Tensor, g: AxisGroup) -> Any:
    """Make ``param``'s gradient the sum over ``g`` of every rank's gradient.

    For a parameter held identically by the ranks of ``g`` whose per-rank gradient is a
    partial sum: a norm gain under sequence parallelism (each rank saw part of the
    sequence), or a key/value head replicated on several tensor-parallel ranks. The hook
    runs on the gradient of each backward pass *before* it is accumulated into
    ``.grad``, so gradient accumulation and data-parallel / ZeRO hooks (which run after
    accumulation) see the summed value. Returns the hook handle.
    """

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad, g)

    return param.register_hook(hook)
