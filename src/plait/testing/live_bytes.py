"""Bytes of live tensor storages, counted from the tensors themselves (allocator-free).

:class:`LiveBytes` is a ``TorchDispatchMode``: every storage an operator returns is
registered (a ``StorageWeakRef``) and dropped once torch frees it, so :meth:`LiveBytes.live`
is the bytes the storages created inside the mode hold now and :attr:`LiveBytes.peak` the
most they held at once, independent of the CPU or CUDA allocator. A storage resized in
place (ZeRO-3's gather buffers: ``untyped_storage().resize_``) counts at its size at the
next operator. Storages made before the mode began are not counted: tests open it before
building what they measure, or read :meth:`live` first and compare differences.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages that operators return, while they are alive,
    and their peak (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def live(self) -> int:
        """Bytes the counted storages hold now (dropping the freed ones; a storage
        resized in place counts at its size now)."""
        dead = [k for k, (ref, _) in self.refs.items() if ref.expired()]
        for k in dead:
            del self.refs[k]
        return sum(
            torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
            for ref, _ in self.refs.values()
        )

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
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                s = t.untyped_storage()
                key, n = s._cdata, s.nbytes()  # the storage itself (its data may move)
                if n and (key not in self.refs or self.refs[key][0].expired()):
                    self.refs[key] = (StorageWeakRef(s), n)
        self.peak = max(self.peak, self.live())
        return out
