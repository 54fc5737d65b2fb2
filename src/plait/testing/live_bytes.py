"""Bytes of live tensor storages, counted from the tensors themselves (allocator-free).

:class:`LiveBytes` is a ``TorchDispatchMode``: every storage an operator returns is
registered (a ``StorageWeakRef``) and dropped once torch frees it, so :meth:`LiveBytes.live`
is the bytes the storages created inside the mode hold now and :attr:`LiveBytes.peak` the
most they held at once, independent of the CPU or CUDA allocator. A storage resized in
place (ZeRO-3's gather buffers: ``untyped_storage().resize_``) counts at its size when an
operator next returns it or a view of it. Storages made before the mode began are not
counted: tests open it before building what they measure, or read :meth:`live` first and
compare differences.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages that operators return, while they are alive,
    and their peak (see the module docstring).

    The exact sum over live storages is a scan of every registered one; it is needed
    only when the peak may have grown. :attr:`upper` is the sum of the sizes last seen
    (frees are noticed only by a scan, so it is never below the live bytes of what it
    has seen): an operator that returns a new storage, or one grown in place since it
    was last seen (a ZeRO-3 gather buffer, counted when an operator returns it or a view
    of it), rescans only when :attr:`upper` exceeds the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, list[Any]] = {}  # storage key -> [weak ref, bytes last seen]
        self.peak = 0
        self.upper = 0

    def live(self) -> int:
        """Bytes the counted storages hold now (dropping the freed ones; a storage
        resized in place counts at its size now)."""
        total = 0
        for key, entry in list(self.refs.items()):
            # a storage may die during this scan (a collection, or a communication
            # thread releasing its buffer): it no longer counts
            s = (
                None
                if entry[0].expired()
                else torch.UntypedStorage._new_with_weak_ptr(entry[0].cdata)
            )
            if s is None:
                del self.refs[key]
                continue
            entry[1] = s.nbytes()
            total += entry[1]
        self.upper = total
        return total

    def reset_peak(self) -> None:
        """Restart the peak from what is live now."""
        self.peak = self.live()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        grew = False
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                s = t.untyped_storage()
                key, n = s._cdata, s.nbytes()  # the storage itself (its data may move)
                entry = self.refs.get(key)
                if entry is None or entry[0].expired():
                    if n:
                        self.refs[key] = [StorageWeakRef(s), n]
                        self.upper += n
                        grew = True
                elif n != entry[1]:
                    self.upper += n - entry[1]
                    entry[1] = n
                    grew = grew or n > 0
        if grew and self.upper > self.peak:
            self.peak = max(self.peak, self.live())
        return out
