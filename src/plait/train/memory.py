"""Per-rank memory report: exact bytes of the training state, read from the tensors.

:func:`memory_report` walks the actual tensors a rank holds — parameters (flat buffers or
ZeRO-3 shards), gradients (buffers, shards, or ``.grad``), the optimizer's separate fp32
master weights, and the optimizer state — and adds up their storage bytes, each storage
counted once (a master that *is* the parameter shard is not counted twice). The result
can be compared with the ZeRO formulas (bytes per parameter with bf16 parameters, fp32
masters and Adam: stage 0: 16, stage 1: 2 + 2 + 12/N, stage 2: 2 + 14/N, stage 3: 16/N)
up to padding. ``peak_memory`` gives the allocator's peak where the device reports one
(CUDA); on the CPU there is no such counter and it returns None.

Start-up memory: :func:`host_peak_bytes` is this process's peak resident set since it
started (``VmHWM`` of ``/proc/self/status``, else ``getrusage``'s ``ru_maxrss``), and
:func:`gather_peak_memory` collects it and the device's allocator peak from every rank
to rank 0 through :mod:`plait.comm` (counted), for the start banner: what building and
loading the model cost each rank. The first step's peak is reported the same way: the
trainer restarts the resident-set peak before the step (:func:`reset_host_peak`, Linux's
``clear_refs``) and the device's, and adds ZeRO-3's counted transient (the most
gathered parameter and full-gradient buffer bytes at once: what the planner's ZeRO-3
buffer term predicts).
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from plait import comm
from plait.mesh import Mesh
from plait.parallel.data_parallel import DataParallel

CATEGORIES = ("params", "grads", "master", "optimizer", "optimizer_scalars", "gathered")
"""Report rows: parameters held persistently, gradients (buffers/shards), separate fp32
master weights, per-element optimizer state (e.g. Adam's m and v), 0-dim optimizer
state (e.g. step counters), and ZeRO-3 parameters gathered at the moment of the report."""


@dataclass
class MemoryReport:
    """Bytes per category and per device of one rank."""

    rank: int
    numel: int  # trainable parameters of the model (unpadded)
    bytes: dict[str, int] = field(default_factory=dict)
    by_device: dict[str, dict[str, int]] = field(default_factory=dict)
    optimizer_ready: bool = True  # False before the first step (state not allocated yet)

    @property
    def total(self) -> int:
        """Sum of every category."""
        return sum(self.bytes.values())

    def per_param(self, category: str) -> float:
        """Bytes of ``category`` per model parameter."""
        return self.bytes.get(category, 0) / max(1, self.numel)

    def as_dict(self) -> dict[str, int]:
        """Flat dict for the metrics file: ``{category: bytes, ..., "total": ...}``."""
        out = {c: self.bytes.get(c, 0) for c in CATEGORIES}
        out["total"] = self.total
        for dev, cats in sorted(self.by_device.items()):
            out[f"total_{dev}"] = sum(cats.values())
        return out

    def format(self) -> str:
        """A small table: category, bytes, MiB, bytes/param, device split."""
        lines = [
            f"memory of rank {self.rank} ({self.numel:,} parameters):",
            f"  {'state':<18} {'bytes':>14} {'MiB':>9} {'B/param':>8}  devices",
        ]
        for c in CATEGORIES:
            b = self.bytes.get(c, 0)
            devs = ", ".join(
                f"{d} {cats[c]:,}" for d, cats in sorted(self.by_device.items()) if cats.get(c)
            )
            note = ""
            if c.startswith("optimizer") and not self.optimizer_ready:
                note = "  (allocated at the first step)"
            lines.append(
                f"  {c:<18} {b:>14,} {b / 2**20:>9.2f} {self.per_param(c):>8.3f}  {devs}{note}"
            )
        lines.append(
            f"  {'total':<18} {self.total:>14,} {self.total / 2**20:>9.2f} "
            f"{self.total / max(1, self.numel):>8.3f}"
        )
        return "\n".join(lines)


class _Counter:
    """Adds storage bytes per category, counting every storage once."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()
        self.bytes: dict[str, int] = {c: 0 for c in CATEGORIES}
        self.by_device: dict[str, dict[str, int]] = {}

    def add(self, category: str, tensors: Iterable[torch.Tensor | None]) -> None:
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0:
                continue
            key = (str(t.device), storage.data_ptr())
            if key in self.seen:
                continue
            self.seen.add(key)
            self.bytes[category] += nbytes
            dev = self.by_device.setdefault(t.device.type, {c: 0 for c in CATEGORIES})
            dev[category] += nbytes


def _optimizer_tensors(optimizer: object) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(per-element state tensors, 0-dim state tensors) of a (wrapped) optimizer."""
    inner = getattr(optimizer, "inner", optimizer)
    elems: list[torch.Tensor] = []
    scalars: list[torch.Tensor] = []
    state = getattr(inner, "state", {})
    for per_param in state.values():
        for v in per_param.values():
            if isinstance(v, torch.Tensor):
                (scalars if v.dim() == 0 else elems).append(v)
    return elems, scalars


def memory_report(model: nn.Module, optimizer: object | None = None, rank: int = 0) -> MemoryReport:
    """Exact per-rank bytes of ``model``'s training state (and ``optimizer``'s, if given).

    ``model`` may be a :class:`~plait.parallel.model.ParallelModel` (its wrapper is
    counted, and under expert parallelism with plain data parallelism the expert
    gradients' buffer, which the wrapper leaves out), a
    :class:`~plait.parallel.zero.ZeroDataParallel` (expert units included), a
    :class:`~plait.parallel.data_parallel.DataParallel` (its bucket buffers count as gradients:
    ``.grad`` are views into them, so each storage is counted once) or any module; ``optimizer`` a
    :class:`plait.optim.Optimizer` or a ``torch.optim`` optimizer.
    """
    from plait.parallel.model import ParallelModel
    from plait.parallel.zero import ZeroDataParallel

    c = _Counter()
    if isinstance(model, ParallelModel):
        sync = model.experts.sync if model.experts is not None else None
        if sync is not None:  # ep > 1 under plain DP: the expert gradients' own buffer
            c.add("grads", [sync.buffer, *(p.grad for p in sync.params)])
        model = model.module
    if isinstance(model, ZeroDataParallel):
        numel = sum(u.numel for u in model.units)
        if model.stage == 3:
            c.add("params", [u.shard for u in model.units])
            c.add("gathered", [u.full for u in model.units])
        else:
            c.add("params", [u.full for u in model.units])
        c.add("grads", [u.grad_full if model.stage <= 1 else u.grad_shard for u in model.units])
        flat = {p for u in model.units for p in u.params}
        rest = [p for p in model.parameters() if p not in flat]  # frozen, not flattened
        c.add("params", rest)
    else:
        params = [p for p in model.parameters()]
        numel = sum(p.numel() for p in params if p.requires_grad)
        c.add("params", params)
        c.add("grads", [p.grad for p in params])
        if isinstance(model, DataParallel):
            c.add("grads", [b.buffer for b in model.buckets])
    ready = True
    if optimizer is not None:
        masters = getattr(optimizer, "master_tensors", None)
        if callable(masters):
            c.add("master", masters())
        elems, scalars = _optimizer_tensors(optimizer)
        c.add("optimizer", elems)
        c.add("optimizer_scalars", scalars)
        ready = bool(elems or scalars)
    return MemoryReport(
        rank=rank, numel=numel, bytes=c.bytes, by_device=c.by_device, optimizer_ready=ready
    )


def reset_peak_memory(device: torch.device) -> None:
    """Restart the device's peak-memory counter (CUDA; nothing elsewhere)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    """Peak bytes allocated on ``device`` since the last reset (CUDA), else None."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


@dataclass(frozen=True)
class PeakMemory:
    """One rank's peak memory over a span: from process start to the end of build and
    load, or one training step."""

    rank: int
    host_bytes: int
    """Peak resident host memory of the process (bytes)."""
    device_bytes: int | None
    """Peak bytes allocated on the rank's accelerator (None on the CPU)."""
    transient_bytes: int | None = None
    """ZeRO-3: the most gathered parameter plus full-gradient buffer bytes at once,
    counted from the tensors (None: not ZeRO-3, or not a step)."""


def host_peak_bytes(status: Path = Path("/proc/self/status")) -> int:
    """This process's peak resident set size in bytes since it started: ``VmHWM`` of
    ``status`` (Linux), else ``ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def reset_host_peak(clear_refs: Path = Path("/proc/self/clear_refs")) -> bool:
    """Restart this process's resident-set peak (``VmHWM``) from its current size
    (Linux: ``5`` written to ``clear_refs``); returns whether it could."""
    try:
        clear_refs.write_text("5")
    except OSError:
        return False
    return True


def gather_peak_memory(mesh: Mesh, mine: PeakMemory | None = None) -> list[PeakMemory] | None:
    """Collective over every rank of ``mesh``: each rank's peaks, ``mine`` (read earlier)
    or now: :func:`host_peak_bytes` and the device peak (:func:`peak_memory`: since the
    process started, or since the last resets), gathered to rank 0 through
    :mod:`plait.comm`. Returns the list in rank order on rank 0 and None on the other
    ranks."""
    if mine is None:
        mine = PeakMemory(mesh.rank, host_peak_bytes(), peak_memory(mesh.device))
    d, z = mine.device_bytes, mine.transient_bytes
    row = [mine.host_bytes, -1 if d is None else d, -1 if z is None else z]
    t = torch.tensor([row], dtype=torch.int64, device=mesh.device)  # NCCL: device tensors
    world = mesh.world()
    parts = comm.gather(t, world, dst=world.ranks.index(0))
    if parts is None:
        return None
    rows = torch.cat(parts).tolist()
    peaks = [
        PeakMemory(
            world.global_rank(i), int(h), None if d < 0 else int(d), None if z < 0 else int(z)
        )
        for i, (h, d, z) in enumerate(rows)
    ]
    return sorted(peaks, key=lambda m: m.rank)
