"""A device scalar on its way to the host: read later without draining the device.

``float(t)`` of a CUDA tensor waits for *every* kernel queued before it (a host sync),
so a training step that logs its loss or gradient norm that way stops the host from
running ahead. :class:`HostScalar` starts the copy instead: on CUDA into a page-locked
host buffer on the current stream, with an event recorded after it; :meth:`value` waits
for that event only (the copy and what the scalar depends on, not later work). On the
CPU the value is already there. Reading goes through NumPy, so no aten op runs on read
(what ``tests/train/test_host_syncs.py`` counts as a sync is the device read itself).
"""

from __future__ import annotations

import torch


class HostScalar:
    """``t`` (a 0-d or one-element tensor) copied to the host without waiting."""

    def __init__(self, t: torch.Tensor) -> None:
        t = t.detach().reshape(())
        self._event: torch.cuda.Event | None = None
        if t.device.type == "cuda":
            self._buf = torch.empty((), dtype=t.dtype, pin_memory=True)
            self._buf.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        elif t.device.type == "cpu":
            self._buf = t.clone()  # the caller may overwrite t in place
        else:  # another accelerator: a plain (waiting) copy
            self._buf = t.to("cpu")
        self._value: float | None = None

    def value(self) -> float:
        """The scalar as a float (the first call waits for its copy)."""
        if self._value is None:
            if self._event is not None:
                self._event.synchronize()
            self._value = float(self._buf.numpy())
        return self._value

    def __float__(self) -> float:
        return self.value()

    def __repr__(self) -> str:
        return f"HostScalar({self.value()!r})"
