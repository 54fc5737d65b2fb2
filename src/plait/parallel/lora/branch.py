"""The low-rank branch of one adapted linear layer, attached from outside.

A targeted layer ``W`` (an ``nn.Linear``, or its tensor-parallel replacement) gets two
children, ``lora_A`` ``(rank, in)`` and ``lora_B`` ``(out, rank)`` (PEFT's names, so the
one-device names read ``layers.0.attention.wq.lora_A.weight``), and computes

    y = W x + (alpha / rank) · B A dropout(x)

(PEFT's ``LoraLayer``). How the branch is attached depends on the layer, never on its
code:

* ``nn.Linear``: a forward hook adds the branch of the layer's input to its output;
* :class:`~plait.parallel.tensor.layers.ColumnParallelLinear` (output features split;
  its input already entered the tensor-parallel region, whole on every tp rank): the
  layer's local product (``local_matmul``) also adds ``B_r A x``, with ``A`` replicated
  and ``B`` split on its output dimension like ``W``. The input's gradient is partial
  per rank, as the base product's is, and the region's existing backward all-reduce sums
  both; ``A``'s gradient is partial too and is summed over tp (rank·in elements);
* :class:`~plait.parallel.tensor.layers.RowParallelLinear` (input features split): the
  local product adds ``B A_r x_r`` to the partial sums *before* the layer's all-reduce
  (or reduce-scatter), so the sum over tp is ``B A x`` by linearity, with ``A`` split on
  its input dimension like ``W`` and ``B`` replicated; ``B``'s gradient is partial
  (each rank saw ``A_r x_r`` only) and is summed over tp (out·rank elements).

No collective of activation size is added: the only new traffic is the replicated
factor's gradient sum per adapted layer and step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.parallel.tensor.layers import ColumnParallelLinear, LocalMatmul, RowParallelLinear

ADAPTABLE = (nn.Linear, ColumnParallelLinear, RowParallelLinear)
"""The layer types an adapter attaches to."""


class LoraBranch:
    """``x -> scale · lora_B(lora_A(dropout(x)))`` of ``layer`` (its children, looked up
    at every call so that a swap of their storage is seen); dropout only in training."""

    def __init__(self, layer: nn.Module, scale: float, dropout: float) -> None:
        self.layer = layer
        self.scale = scale
        self.dropout = dropout

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in)`` (the layer's local input) -> ``(..., out)`` (its local output)."""
        a = factor(self.layer, "lora_A")  # (rank, in)
        b = factor(self.layer, "lora_B")  # (out, rank)
        if self.dropout and self.layer.training:
            x = F.dropout(x, self.dropout)
        h = F.linear(x.to(a.dtype), a)  # (..., rank)
        return (F.linear(h, b) * self.scale).to(x.dtype)  # (..., out)


class LoraMatmul:
    """A tensor-parallel layer's local product with the branch added:
    ``(x, W, b) -> base(x, W, b) + branch(x)`` (``base``: the layer's previous product,
    None for ``F.linear``)."""

    def __init__(self, base: LocalMatmul | None, branch: LoraBranch) -> None:
        self.base = base
        self.branch = branch

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``(b, s, in_local)`` -> ``(b, s, out_local)``."""
        y = (self.base or F.linear)(x, w, bias)
        return y + self.branch(x)


def attach(layer: nn.Module, a: nn.Parameter, b: nn.Parameter, branch: LoraBranch) -> None:
    """Register ``a`` ``(rank, in_local)`` and ``b`` ``(out_local, rank)`` as
    ``layer.lora_A.weight`` / ``layer.lora_B.weight`` and route ``layer``'s output
    through ``branch`` (see the module docstring)."""
    for name, p in (("lora_A", a), ("lora_B", b)):
        factor = nn.Module()
        factor.weight = p
        layer.add_module(name, factor)
    if isinstance(layer, ColumnParallelLinear | RowParallelLinear):
        layer.local_matmul = LoraMatmul(layer.local_matmul, branch)
    else:
        layer.register_forward_hook(_add_branch(branch))


def _add_branch(branch: LoraBranch) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return out + branch(args[0])

    return hook


def factor(layer: nn.Module, name: str) -> torch.Tensor:
    """``layer``'s factor ``name`` ("lora_A" / "lora_B") weight."""
    child = layer.get_submodule(name)
    w = child.weight
    assert isinstance(w, torch.Tensor)
    return w


def weight_of(layer: nn.Module) -> torch.Tensor:
    """``layer``'s (local) weight ``(out_local, in_local)``."""
    w = layer.weight
    assert isinstance(w, torch.Tensor)
    return w


def local_features(layer: nn.Module) -> tuple[int, int]:
    """(in, out) features this rank's piece of ``layer`` multiplies."""
    w = weight_of(layer)  # (out_local, in_local)
    return int(w.shape[1]), int(w.shape[0])
