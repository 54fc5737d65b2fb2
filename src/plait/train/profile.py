"""Seeing inside a step: a ``torch.profiler`` trace for a window of steps and a CUDA
memory snapshot at the step of peak memory, per rank, into the run folder.

* ``log.profile = "START-END"`` (1-based optimizer steps, inclusive, as the metrics
  number them): the profiler starts before step START and stops after step END; each
  rank writes ``<log.dir>/profile/rank<r>.json`` (Chrome trace format; open it in
  Perfetto, https://ui.perfetto.dev, or ``chrome://tracing``). While it records, every
  block's forward is labelled (``plait.forward``, ``plait.forward.<name>``), each step
  is ``plait.step.<n>``; backward shows as autograd's ``autograd::engine::evaluate_function``
  events and each counted collective of :mod:`plait.comm` as its ``gloo:``/``nccl:``
  record (and ``plait.comm.<op>`` where the comm layer labels it). On CUDA the kernels
  are recorded too.
* ``log.memory_snapshot = true`` (CUDA only; refused on CPU before any rank starts,
  :func:`check_memory_snapshot`): ``torch.cuda.memory._record_memory_history`` from the
  first step; after each step whose peak exceeds every earlier one the snapshot is
  written again, so ``<log.dir>/memory/rank<r>.pickle`` ends as the snapshot of the step
  of peak memory (drag it into https://pytorch.org/memory_viz).

Files are written to a temporary name and renamed. See docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function

from plait.config import LogConfig
from plait.config.rules.features import parse_step_window
from plait.errors import ConfigError

MEMORY_HISTORY_ENTRIES = 100_000
"""Allocation events the CUDA memory history keeps (torch's default is 100,000)."""


def check_memory_snapshot(enabled: bool, device: str) -> None:
    """Refuse ``log.memory_snapshot`` unless ``device`` ("auto", "cpu", "cuda") is CUDA:
    the snapshot is of CUDA's caching allocator."""
    if not enabled:
        return
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda":
        raise ConfigError(
            "log.memory_snapshot needs a CUDA device (it records CUDA's caching allocator); "
            "this run is on the CPU. Use log.profile = 'START-END' to see a CPU step, or "
            "run on a GPU."
        )


def _write(path: Path, write: Any) -> None:
    """Call ``write(tmp)`` and rename ``tmp`` to ``path`` (no half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(str(tmp))
    tmp.replace(path)


class _Labels:
    """Forward pre/post hooks that wrap a module's forward in a ``record_function``."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.open: dict[int, list[Any]] = {}

    def add(self, module: nn.Module, label: str) -> None:
        def pre(mod: nn.Module, args: Any) -> None:
            rf = record_function(label)
            rf.__enter__()
            self.open.setdefault(id(mod), []).append(rf)

        def post(mod: nn.Module, args: Any, out: Any) -> None:
            stack = self.open.get(id(mod))
            if stack:
                stack.pop().__exit__(None, None, None)

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def label_forward(model: nn.Module) -> _Labels:
    """Label the forward of ``model`` (``plait.forward``) and of every element of its
    ``nn.ModuleList`` s (the blocks: ``plait.forward.<name>``); remove with ``.remove()``."""
    labels = _Labels()
    wrapped = getattr(model, "module", None)
    inner = wrapped if isinstance(wrapped, nn.Module) else model
    labels.add(inner, "plait.forward")  # a ParallelModel's step calls its .module
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList):
            while name.startswith("module."):  # the wrappers' prefixes: one-device names
                name = name[len("module.") :]
            for i, block in enumerate(mod):
                labels.add(block, f"plait.forward.{name}.{i}")
    return labels


class StepProfiler:
    """The trainer's hook: ``with prof.step(n): ...`` around optimizer step ``n``
    (1-based), ``prof.after_step(n)`` after it, ``prof.close()`` at the end."""

    def __init__(self, cfg: LogConfig, rank: int, device: torch.device, model: nn.Module) -> None:
        self.window = parse_step_window(cfg.profile) if cfg.profile else None
        self.folder = Path(cfg.dir)
        self.rank, self.device, self.model = rank, device, model
        self.prof: torch.profiler.profile | None = None
        self.labels: _Labels | None = None
        self.snapshot = cfg.memory_snapshot and device.type == "cuda"
        self.best_peak = -1
        self.trace_path = self.folder / "profile" / f"rank{rank}.json"
        self.snapshot_path = self.folder / "memory" / f"rank{rank}.pickle"

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        """Profile step ``n`` when it is in the window (start the profiler at its first
        step, stop and write the trace after its last)."""
        if self.snapshot and self.best_peak < 0:  # from the first step on
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            self.best_peak = 0
        if self.window is not None and n == self.window[0] and self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=False)
            self.prof.__enter__()
            self.labels = label_forward(self.model)
        if self.prof is None:
            yield
            return
        with record_function(f"plait.step.{n}"):
            yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.window is not None and n >= self.window[1]:
            self._stop()

    def after_step(self, n: int, peak_bytes: int | None) -> None:
        """Write the memory snapshot when step ``n``'s peak is the highest so far."""
        if not self.snapshot or peak_bytes is None or peak_bytes <= self.best_peak:
            return
        self.best_peak = peak_bytes
        _write(self.snapshot_path, torch.cuda.memory._dump_snapshot)

    def _stop(self) -> None:
        prof, self.prof = self.prof, None
        if self.labels is not None:
            self.labels.remove()
            self.labels = None
        if prof is not None:
            prof.__exit__(None, None, None)
            _write(self.trace_path, prof.export_chrome_trace)

    def close(self) -> None:
        """Write a trace whose window the run did not reach the end of; stop recording
        memory history."""
        self._stop()
        if self.snapshot and self.best_peak >= 0:
            torch.cuda.memory._record_memory_history(enabled=None)
