"""Activation offloading: what a block saves for backward moves to host memory in forward
and comes back before its backward (``train.activation_offload``).

Backward needs the tensors forward saved; at long context or large micro-batches they
dominate device memory. Recomputation (:mod:`plait.parallel.recompute`) drops them and
pays compute; offloading keeps them, in host memory, and pays copies that overlap
compute (torchtitan, Megatron-LM / TransformerEngine's CPU offloading). While a block
runs forward, :func:`torch.autograd.graph.saved_tensors_hooks` hands every tensor it
saves to an :class:`OffloadPool`:

* **pack** (forward) copies the tensor into a host buffer (page-locked on CUDA, copied on
  the pool's side stream after the compute stream's pending work; the device tensor is
  kept alive for the copy by ``record_stream``) and gives autograd the copy: the device
  storage is released as soon as nothing else holds it;
* **unpack** (backward) hands the copy back on the device. On CUDA the copies of a
  block come back on the side stream, and the first unpack of a block also starts the
  copies of the block that ran before it in forward (the next one backward needs), so
  they overlap the backward compute; the compute stream waits only for the copy it
  needs. On the CPU the host copy *is* the tensor handed back (no second copy), so
  losses and gradients are bit-exact against no offloading.

Parameters (and views of them) are not offloaded: they are not activations, and under
ZeRO-3 a block's parameters are freed and gathered again around its backward anyway.
Only the first ``blocks`` blocks of a rank's model (its pipeline stage's) are offloaded
when a count is given: the earliest blocks' activations live longest (backward reaches
them last). The wrapper goes around each block's ``forward`` outermost, after
recomputation and compilation (the hooks then see the compiled graph's saved tensors
and, under recomputation, the checkpoint's kept inputs).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from plait.parallel.zero.flat import default_block_classes


class _Group:
    """The tensors one block's forward saved (one call), in pack order."""

    def __init__(self, prev: _Group | None) -> None:
        self.items: weakref.WeakSet[_Packed] = weakref.WeakSet()
        self.prev = weakref.ref(prev) if prev is not None else None
        self.fetched = False


class _Packed:
    """One saved tensor's host copy (and, once fetched, its device copy)."""

    __slots__ = ("__weakref__", "device", "event", "group", "host", "on_device")

    def __init__(self, host: torch.Tensor, device: torch.device, group: _Group) -> None:
        self.host, self.device, self.group = host, device, group
        self.event: torch.cuda.Event | None = None  # the device-to-host copy (CUDA)
        self.on_device: torch.Tensor | None = None  # fetched ahead of its unpack (CUDA)


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class OffloadPool:
    """Host copies of saved activations, with their byte counts.

    Args:
        device: the device the activations are computed on (CUDA: page-locked host
            buffers and a side stream; CPU: plain host copies).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.live_bytes = 0
        """Bytes of host copies held now (freed with autograd's graph)."""
        self.peak_bytes = 0
        """The most host-copy bytes held at once."""
        self.copied_bytes = 0
        """Bytes copied to the host since the pool was made."""
        self._group: _Group | None = None  # the block running forward now
        self._last: _Group | None = None  # the previous block's (for the prefetch chain)

    # ------------------------------------------------------------------ forward

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The saved-tensor hooks of one block's forward: opens a new group."""
        self._group = _Group(self._last)
        self._last = self._group
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        """Forward: ``t``'s host copy (parameters, and tensors already on the host while
        computing on a device, are kept as they are)."""
        if _is_parameter(t) or (self.cuda and t.device.type != "cuda") or self._group is None:
            return t
        if self.cuda:
            assert self.stream is not None
            host = torch.empty_like(t, device="cpu", pin_memory=True)  # t's strides
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)
            p = _Packed(host, t.device, self._group)
            p.event = torch.cuda.Event()
            p.event.record(self.stream)
        else:
            host = torch.empty_like(t, device="cpu")  # t's strides (dense): same kernels
            host.copy_(t)
            p = _Packed(host, t.device, self._group)
        self._group.items.add(p)
        n = host.numel() * host.element_size()
        self.live_bytes += n
        self.copied_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(p, self._release, n)
        return p

    def _release(self, n: int) -> None:
        self.live_bytes -= n

    # ------------------------------------------------------------------ backward

    def unpack(self, p: Any) -> torch.Tensor:
        """Backward: the saved tensor on its device (CUDA: fetched on the side stream,
        with the previous block's copies started behind it)."""
        if not isinstance(p, _Packed):
            return p
        if not self.cuda:
            return p.host
        if not p.group.fetched:
            self._fetch(p.group)
            prev = p.group.prev() if p.group.prev is not None else None
            if prev is not None and not prev.fetched:
                self._fetch(prev)
        out = p.on_device
        if out is None:  # unpacked again (a second backward over the same graph)
            self._fetch_one(p)
            out = p.on_device
        assert out is not None and p.event is not None
        torch.cuda.current_stream(p.device).wait_event(p.event)
        out.record_stream(torch.cuda.current_stream(p.device))
        p.on_device = None  # autograd owns it now
        return out

    def _fetch(self, g: _Group) -> None:
        g.fetched = True
        for p in list(g.items):
            self._fetch_one(p)

    def _fetch_one(self, p: _Packed) -> None:
        assert self.stream is not None and p.event is not None
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(p.event)
            p.on_device = p.host.to(p.device, non_blocking=True)
            p.event = torch.cuda.Event()
            p.event.record(self.stream)

    def end_forward(self) -> None:
        """A block's forward ended: later saved tensors are not this block's."""
        self._group = None

    def reset_peak(self) -> None:
        """Restart the peak from the bytes held now."""
        self.peak_bytes = self.live_bytes


def _offload_forward(pool: OffloadPool, orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return orig(*args, **kwargs)
    try:
        with pool.hooks():
            return orig(*args, **kwargs)
    finally:
        pool.end_forward()


def apply_activation_offload(
    model: nn.Module,
    pool: OffloadPool,
    blocks: int = 0,
    block_classes: Sequence[type[nn.Module]] | None = None,
) -> list[str]:
    """Offload the saved activations of ``model``'s first ``blocks`` blocks (0: every
    block) into ``pool``; returns the qualified names of the blocks changed. Blocks as
    for recomputation (:func:`~plait.parallel.recompute.apply_recompute`)."""
    classes = tuple(block_classes) if block_classes is not None else default_block_classes(model)
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, classes)]
    if not found:
        raise ValueError(
            "activation offload: the model has no block of "
            f"{[c.__name__ for c in classes]}; pass block_classes"
        )
    chosen = found[:blocks] if blocks > 0 else found
    for _, m in chosen:
        m.forward = functools.partial(_offload_forward, pool, m.forward)
    return [n for n, _ in chosen]
