"""The background loader: a thread per rank prepares the next batches while a step runs.

:class:`BackgroundLoader` reads this rank's batch of steps ``start, start + 1, ...`` (the
sampler's :meth:`~plait.data.sampler.BatchSampler.rank_indices`, so the order is the
sampler's pure function of ``(seed, step)``) into a bounded queue of ``depth`` batches,
in pinned memory when ``pin`` (CUDA; the copy to the device can then be asynchronous):
each tensor is copied into a fresh *contiguous* pinned buffer (:func:`pinned`), since a
pinned strided view (the inputs ``w[:, :-1]`` of a window ``w``) would make
``.to(device, non_blocking=True)`` stage it through a pageable contiguous copy first.
``get(step)`` returns step ``step``'s batch: the queued one when the steps run in order,
otherwise (a jump, e.g. after a resume) the thread restarts at ``step``. A failure in the
thread is raised by ``get``.
"""

from __future__ import annotations

import inspect
import queue
import threading
import weakref
from collections.abc import Callable

import torch

from plait.data.parts import is_absent

Batch = tuple[torch.Tensor, ...]
"""``(inputs, targets)``, each ``(batch, seq)``, and any further per-token tensors of the
step (a packed set's document ids): every tensor is pinned alike."""


def _pinned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def pinned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a new contiguous page-locked buffer (one copy, whatever ``t``'s
    strides): what an asynchronous host-to-device copy needs to stay asynchronous. An
    absent part (:mod:`plait.data.parts`) is returned as it is: nothing to copy."""
    if is_absent(t):
        return t
    buf = _pinned_empty(t.shape, t.dtype)  # (same shape as t), contiguous
    buf.copy_(t)
    return buf


class BackgroundLoader:
    """Batches of steps read ahead in a daemon thread (see the module's docstring)."""

    def __init__(self, read: Callable[[int], Batch], depth: int = 2, pin: bool = False) -> None:
        # a bound method is held weakly: a trainer dropped without close() ends the thread
        self._read: Callable[[], Callable[[int], Batch] | None] = (
            weakref.WeakMethod(read) if inspect.ismethod(read) else (lambda: read)
        )
        self.depth = max(1, depth)
        self.pin = pin
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue[tuple[int, Batch | BaseException]] = queue.Queue(self.depth)
        self._next = -1

    def _work(self, start: int, stop: threading.Event, q: queue.Queue) -> None:
        step = start
        while not stop.is_set():
            item: Batch | BaseException
            read = self._read()
            if read is None:  # the owner is gone
                return
            try:
                got = read(step)
                item = tuple(pinned(t) for t in got) if self.pin else tuple(got)
            except BaseException as exc:  # handed to the consumer, raised there
                item = exc
            del read
            while not stop.is_set():
                try:
                    q.put((step, item), timeout=0.1)
                    break
                except queue.Full:
                    if self._read() is None:
                        return
            if isinstance(item, BaseException):
                return
            step += 1

    def _start(self, step: int) -> None:
        self.close()
        self._stop = threading.Event()
        self._queue = queue.Queue(self.depth)
        self._thread = threading.Thread(
            target=self._work,
            args=(step, self._stop, self._queue),
            daemon=True,
            name="plait-data-loader",
        )
        self._thread.start()
        self._next = step

    def get(self, step: int) -> Batch:
        """This rank's batch of step ``step``."""
        if self._thread is None or step != self._next:
            self._start(step)
        got, item = self._queue.get()
        assert got == step, (got, step)
        if isinstance(item, BaseException):
            self._thread = None
            raise item
        self._next = step + 1
        return item

    def close(self) -> None:
        """Stop the thread (it exits after its current read)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
