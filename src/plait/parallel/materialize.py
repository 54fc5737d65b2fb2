"""Allocate and initialise only this rank's pieces of a model built on the meta device.

``parallelize`` applies tensor parallelism, context parallelism and the pipeline split
to the meta model (shapes only), so what is left on a rank is exactly what it keeps:
its tensor-parallel blocks of its pipeline stage. Then, for each tensor still on the
meta device, the one-device initial value is computed alone on the CPU
(:class:`~plait.model.init.InitialValues`, by the tensor's one-device name), cut to the
block this tp rank holds (:class:`LocalInit`) and copied to the rank's device:

* plain data parallelism and ZeRO stages 0-2 keep the full replica:
  :func:`materialize_module` gives every parameter and buffer its storage;
* ZeRO stage 3 keeps a flat shard: :func:`materialize_module` with ``params=False``
  gives storage to the buffers and the frozen parameters only, and
  :class:`~plait.parallel.zero.ZeroDataParallel` copies each trainable parameter's run
  of this rank's shard from :class:`LocalInit` (the full unit is never allocated).

The values are those of a one-device build, bit for bit, so every layout starts from
the same weights. Transient host memory: one full one-device tensor at a time (plus its
tensor-parallel padding), or, for a model initialised module by module (``model.factory``
and ``hf-llama`` models), one owner module's own tensors.

A parameter gets its storage by :func:`torch.utils.swap_tensors`, so its identity (the
names, the optimizer, the pipeline's tied copy) and its attributes are kept; gradient
hooks do not survive the swap, so the tensor-parallel gradient sums remembered on it
are registered again (:func:`~plait.parallel.tensor.sequence.register_grad_sums`).
"""

from __future__ import annotations

import torch
from torch import nn

from plait.model.init import InitialValues
from plait.parallel.tensor.layers import shard_info
from plait.parallel.tensor.sequence import register_grad_sums


class LocalInit:
    """This rank's initial value of a parameter or buffer: the one-device value named
    ``names[id(tensor)]`` (``names`` maps every tensor left on the rank, after the
    tensor-parallel and pipeline changes, to its one-device name), cut to the block tp
    rank ``tp_index`` holds, in the tensor's dtype, on the CPU."""

    def __init__(self, values: InitialValues, names: dict[int, str], tp_index: int) -> None:
        self.values = values
        self.names = names
        self.tp_index = tp_index

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """``(t.shape)`` the value of ``t`` (a meta tensor this rank keeps)."""
        name = self.names[id(t)]
        full = self.values.value(name)
        info = shard_info(t)
        piece = info.shard(full, self.tp_index) if info is not None else full
        if tuple(piece.shape) != tuple(t.shape):
            raise RuntimeError(
                f"{name}: its initial value has shape {tuple(piece.shape)} here, but the "
                f"tensor is {tuple(t.shape)}"
            )
        return piece.to(t.dtype)


def tensor_names(model: nn.Module) -> dict[int, str]:
    """id(tensor) -> one-device name of every parameter and buffer of ``model`` (a
    tensor reachable under several names is named by its first)."""
    out: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), n)
    for n, b in model.named_buffers(remove_duplicate=False):
        out.setdefault(id(b), n)
    return out


def unallocated(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A ``(numel,)`` tensor whose storage holds 0 bytes (grown later with
    ``untyped_storage().resize_``): ZeRO-3's full unit buffer before its first gather.
    torch gives such a tensor no other way than allocating it and releasing its
    storage at once: a transient of one unit (never written, so on the CPU never
    touched; on a GPU the caching allocator hands the block to the first gather)."""
    t = torch.empty(numel, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


@torch.no_grad()
def give_storage(p: nn.Parameter, value: torch.Tensor) -> None:
    """Make ``p`` hold ``value`` (any device), keeping the object, its attributes and
    its tensor-parallel gradient sums."""
    saved = dict(p.__dict__)
    new = nn.Parameter(value, requires_grad=p.requires_grad)
    torch.utils.swap_tensors(p, new)
    p.__dict__.clear()
    p.__dict__.update(saved)
    register_grad_sums(p)


@torch.no_grad()
def materialize_module(
    modules: list[nn.Module], init: LocalInit, device: torch.device, params: bool = True
) -> None:
    """Give storage on ``device`` to every meta tensor of ``modules`` (and move any
    other tensor there): buffers always, parameters when ``params`` (else only the
    frozen ones; ZeRO-3 shards the trainable ones itself). A tensor shared by several
    modules (tied weights, the rotary tables a pipeline piece shares) is done once."""
    done: dict[int, torch.Tensor] = {}
    # The replaced tensors are kept alive to the end: ``done`` is keyed by ``id``, and a
    # freed meta buffer's id can be handed to a new tensor (another buffer's value),
    # which a later root sharing that module would then map to the wrong value.
    replaced: list[torch.Tensor] = []
    for root in modules:
        for m in root.modules():
            for k, b in m._buffers.items():
                if b is None:
                    continue
                if id(b) not in done:
                    value = init(b) if b.is_meta else b
                    done[id(b)] = value.to(device)
                    done[id(done[id(b)])] = done[id(b)]
                    replaced.append(b)
                m._buffers[k] = done[id(b)]
            for p in m._parameters.values():
                if p is None or id(p) in done or (not params and p.requires_grad):
                    continue
                if p.is_meta:  # the kept tensor first: the transients are freed above it
                    kept = torch.empty(p.shape, dtype=p.dtype, device=device)
                    give_storage(p, kept.copy_(init(p)))
                elif p.device != device:
                    give_storage(p, p.detach().to(device))
                done[id(p)] = p
