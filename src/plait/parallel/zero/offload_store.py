"""ZeRO-Infinity's NVMe tier: offloaded optimizer state (and masters) kept in files.

With ``parallel.offload_dir = PATH`` every slot (one ZeRO unit's shard on this rank)
gets one file ``PATH/rank{r}/unit{i}.bin`` holding its Adam state ``m | v`` (and, with
``offload = params``, its fp32 master first: ``master | m | v``), mapped into memory
with ``torch.from_file(shared=True)``: the optimizer reads and writes the mapping, the
kernel's page cache decides what stays in RAM (state larger than host memory is paged
to the disk), and dirty pages are written back asynchronously while the next slots
step. Before a slot steps, the next slot's file is announced to the kernel
(``posix_fadvise(WILLNEED)``: an asynchronous read-ahead), so reads overlap the
current slot's step (Rajbhandari et al. 2021, "ZeRO-Infinity", overlap-centric design).

:func:`check_offload_dir` refuses, before any work starts, a folder that cannot be
created or written, or whose free space is below what the files need
(:class:`~plait.errors.ConfigError`, exit code 2).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from plait.config.rules.features import check_offload_dir

__all__ = ["FileSlot", "OffloadStore", "check_offload_dir", "disk_bytes_needed"]


class FileSlot:
    """One slot's file: tensors of ``dtype`` (the masters': fp32, or fp64 for a float64
    model) mapped from ``path`` (``sizes`` elements each)."""

    def __init__(self, path: Path, sizes: list[int], dtype: torch.dtype = torch.float32) -> None:
        self.path = path
        total = sum(sizes)
        item = torch.empty((), dtype=dtype).element_size()
        with open(path, "wb") as f:  # sparse: nothing is written until the state is
            f.truncate(total * item)
        flat = torch.from_file(str(path), shared=True, size=total, dtype=dtype)
        self.flat = flat  # (total,) the whole mapping
        self.parts: list[torch.Tensor] = []
        at = 0
        for n in sizes:
            self.parts.append(flat[at : at + n])
            at += n

    def prefetch(self) -> None:
        """Ask the kernel to read the file ahead (asynchronous; a no-op where the
        platform has no ``posix_fadvise``)."""
        advise = getattr(os, "posix_fadvise", None)
        if advise is None:
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


class OffloadStore:
    """The files of one rank under ``folder`` (``rank{rank}/``), one per slot."""

    def __init__(self, folder: str | os.PathLike[str], rank: int) -> None:
        self.folder = Path(folder) / f"rank{rank}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.slots: list[FileSlot] = []

    def add(self, index: int, sizes: list[int], dtype: torch.dtype = torch.float32) -> FileSlot:
        """The mapped file of slot ``index`` with parts of ``sizes`` elements of ``dtype``."""
        slot = FileSlot(self.folder / f"unit{index}.bin", sizes, dtype)
        self.slots.append(slot)
        return slot

    @property
    def disk_bytes(self) -> int:
        """Bytes of every file (their mapped size)."""
        return sum(s.flat.numel() * s.flat.element_size() for s in self.slots)


def disk_bytes_needed(shard_numels: list[int], masters: bool, item: int = 4) -> int:
    """Bytes the files of one rank take: Adam's m and v (and the master with
    ``masters``) per element of each slot, ``item`` bytes each (fp32: 4)."""
    per = 3 if masters else 2
    return sum(per * n * item for n in shard_numels)
