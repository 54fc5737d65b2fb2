"""Activation recomputation (gradient checkpointing), applied from outside the model.

Backward needs activations saved by forward; storing them for every layer dominates
memory at long sequences. Recomputation keeps less and recomputes the rest during
backward (Chen et al. 2016). Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models") observe that the attention core — QKᵀ, softmax, dropout,
·V — holds much of the memory but little of the FLOPs, and recompute only that:

* ``"full"`` — each transformer block keeps only its inputs; the whole block runs again
  in backward (one extra forward per block, about +33% compute).
* ``"selective"`` — inside each block only the attention core is recomputed: every call
  of ``F.scaled_dot_product_attention`` made by the block is checkpointed, so the
  kernel's outputs and its internal saved state are dropped and only q, k, v are kept.
  ``torch.nn.MultiheadAttention`` calls its kernel inside
  ``F.multi_head_attention_forward``, which is then checkpointed as a whole (its
  projections are recomputed too).

Both use ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved), so gradients are
bitwise identical to no recomputation. The block's ``forward`` is replaced on the
instance, so parameter names and the model code stay unchanged.
:class:`SavedActivations` measures the bytes kept for backward with saved-tensor hooks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from plait.config import RECOMPUTES, Recompute
from plait.config.rules.choices import check_choice
from plait.parallel.zero.flat import default_block_classes

_ATTENTION_CORE: tuple[Callable[..., Any], ...] = (
    F.scaled_dot_product_attention,
    F.multi_head_attention_forward,
)


def _checkpoint_qkv(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``checkpoint(func, *args, **kwargs)`` that keeps the identity of repeated q/k/v.

    Checkpoint hands each input back as its own tensor when it recomputes, but
    ``F.multi_head_attention_forward`` picks its (packed) projection path by testing
    ``query is key``; the first three positional arguments are therefore passed once
    each and re-expanded inside, so the recomputation takes the forward's path.
    """
    head = list(args[:3])
    unique: list[Any] = []
    index: list[int] = []
    for t in head:
        j = next((k for k, u in enumerate(unique) if u is t), -1)
        if j < 0:
            unique.append(t)
            j = len(unique) - 1
        index.append(j)
    n = len(unique)

    def run(*inputs: Any, **kw: Any) -> Any:
        qkv = [inputs[i] for i in index]
        return func(*qkv, *inputs[n:], **kw)

    return checkpoint(run, *unique, *args[3:], use_reentrant=False, **kwargs)


class _AttentionCoreCheckpoint(TorchFunctionMode):
    """Checkpoints each attention-core call made while the mode is active."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _ATTENTION_CORE and torch.is_grad_enabled():
            return _checkpoint_qkv(func, args, kwargs)
        return func(*args, **kwargs)


def _full_forward(orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return orig(*args, **kwargs)
    return checkpoint(orig, *args, use_reentrant=False, **kwargs)


def _selective_forward(orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return orig(*args, **kwargs)
    with _AttentionCoreCheckpoint():
        return orig(*args, **kwargs)


def apply_recompute(
    model: nn.Module,
    mode: Recompute,
    block_classes: Sequence[type[nn.Module]] | None = None,
) -> list[str]:
    """Make every block of ``model`` recompute in backward according to ``mode``.

    Blocks are the modules of ``block_classes`` (default: plait's ``Block``, torch's
    transformer encoder/decoder layers and a Hugging Face model's
    ``_no_split_modules``). Returns the qualified names of the blocks changed.
    ``mode="none"`` restores the original forwards.
    """
    check_choice("recompute", mode, RECOMPUTES)
    classes = tuple(block_classes) if block_classes is not None else default_block_classes(model)
    names = []
    for name, m in model.named_modules():
        if not isinstance(m, classes):
            continue
        if "forward" in m.__dict__:  # undo an earlier recompute wrapper
            del m.forward
        if mode != "none":
            orig = m.forward
            wrapper = _full_forward if mode == "full" else _selective_forward
            m.forward = functools.partial(wrapper, orig)
        m._plait_recompute = mode  # type: ignore[assignment]
        names.append(name)
    if mode != "none" and not names:
        raise ValueError(
            f"recompute={mode!r}: the model has no block of {[c.__name__ for c in classes]}; "
            "pass block_classes"
        )
    return names


class SavedActivations:
    """Counts the bytes autograd keeps for backward while the context is active.

    Every tensor packed by a saved-tensor hook is counted once per storage (storage
    bytes, so views of one buffer count once). Storages of ``exclude`` (the parameters
    and buffers, which are not activations) are skipped. Under recomputation the
    checkpoint keeps its inputs through the same hooks, so they are counted too.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._exclude and storage.nbytes() > 0:
            self._storages[ptr] = storage.nbytes()
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def bytes(self) -> int:
        """Distinct storage bytes saved for backward so far."""
        return sum(self._storages.values())

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
