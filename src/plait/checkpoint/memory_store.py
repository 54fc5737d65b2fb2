"""Where in-memory checkpoint copies live between a rank's death and the job's restart.

Every ``train.memory_checkpoint_every`` steps each rank holds two copies in host
memory: its own pieces and its *ward*'s (the rank whose buddy it is,
:func:`buddy_of`). They live in a folder of ``/dev/shm`` (RAM, not disk) whose lifetime
is the launcher's, not the rank's: plait's launcher (or torchrun's agent, per node) restarts
every worker after a failure, and a copy kept in a worker's own heap would die with it.
One folder per holding rank, ``holder<h>/step_<n>/rank<r>.safetensors`` (+ its index
``rank<r>.json``; rank 0's carries the checkpoint's header), renamed from
``.tmp-step_<n>`` once both copies are in, so a half-made copy is never used; the
previous step's folder is then removed (each rank holds one step, twice).

After a loss the launcher calls :func:`recover`: the holders that died lose their
folders (their memory is gone, as on another node), and the newest step of which every
rank's pieces still have a copy (its own or its buddy's) is assembled into an ordinary
checkpoint folder (hard links, no copy; the metadata merged as a save merges it), which
any layout resumes from (:mod:`plait.checkpoint.read` reshards). When a rank and its
buddy both died nothing is assembled and the caller falls back to the disk checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.checkpoint.files import fsync_dir
from plait.checkpoint.format import (
    METADATA,
    index_name,
    json_bytes,
    rank_filename,
    step_dirname,
)

STORE_ENV = "PLAIT_MEMORY_STORE"
"""The folder of the memory copies, set by the launcher for its ranks."""


def buddy_of(rank: int, world: int, per_node: int) -> int:
    """The rank that holds ``rank``'s copy: the same local rank on the next node when
    there are several nodes of ``per_node`` ranks (no node holds its own copy), else
    the next rank."""
    shift = per_node if per_node < world and world % per_node == 0 else 1
    return (rank + shift) % world


def ward_of(rank: int, world: int, per_node: int) -> int:
    """The rank whose copy ``rank`` holds (:func:`buddy_of`'s inverse)."""
    shift = per_node if per_node < world and world % per_node == 0 else 1
    return (rank - shift) % world


def default_root() -> Path:
    """A fresh store folder in ``/dev/shm`` (RAM), or in the temporary folder without it."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="plait-memory-", dir=base))


class MemoryStore:
    """The copies held by the ranks of one job, in the folder ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def holder(self, h: int) -> Path:
        return self.root / f"holder{h:05d}"

    def put(self, holder: int, rank: int, step: int, index: bytes, file: bytes) -> int:
        """Keep ``rank``'s pieces of ``step`` (its index and safetensors bytes) in
        ``holder``'s memory; returns the bytes kept."""
        tmp = self.holder(holder) / f".tmp-{step_dirname(step)}"
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / rank_filename(rank)).write_bytes(file)
        (tmp / index_name(rank)).write_bytes(index)
        return len(file) + len(index)

    def complete(self, holder: int, step: int) -> None:
        """``holder`` has both copies of ``step``: make them usable, drop older ones."""
        home = self.holder(holder)
        final = home / step_dirname(step)
        shutil.rmtree(final, ignore_errors=True)
        (home / f".tmp-{step_dirname(step)}").rename(final)
        for old in home.iterdir():
            if old != final:
                shutil.rmtree(old, ignore_errors=True)

    def held_bytes(self, holder: int) -> int:
        """Bytes of host memory ``holder``'s copies take."""
        home = self.holder(holder)
        return sum(p.stat().st_size for p in home.rglob("*") if p.is_file()) if home.exists() else 0

    def forget(self, holders: set[int]) -> None:
        """The copies held by ``holders`` are gone (those ranks died)."""
        for h in holders:
            shutil.rmtree(self.holder(h), ignore_errors=True)

    def copies(self) -> dict[int, dict[int, Path]]:
        """step -> {rank: the folder holding a complete copy of it}."""
        out: dict[int, dict[int, Path]] = {}
        for home in sorted(self.root.glob("holder*")):
            for folder in home.glob("step_*"):
                step = int(folder.name.removeprefix("step_"))
                for ix in folder.glob("rank*.json"):
                    out.setdefault(step, {})[int(ix.stem.removeprefix("rank"))] = folder
        return out


@dataclass(frozen=True)
class Recovery:
    """What :func:`recover` found."""

    folder: Path | None
    """The assembled checkpoint (None: no step has a copy of every rank)."""
    step: int | None
    why: str
    """One sentence: which copies were used, or what is missing."""


def recover(store: MemoryStore, world: int, lost: set[int]) -> Recovery:
    """Forget the copies ``lost`` ranks held, then assemble the newest step whose every
    rank has a surviving copy into ``<root>/recovered/step_<n>`` (a checkpoint folder).
    Every holder's copies are dropped after (they belong to the old world; the next
    world makes its own)."""
    store.forget(lost)
    copies = store.copies()
    try:
        return _recover(store, world, copies)
    finally:
        store.forget({int(h.name.removeprefix("holder")) for h in store.root.glob("holder*")})


def _recover(store: MemoryStore, world: int, copies: dict[int, dict[int, Path]]) -> Recovery:
    for step in sorted(copies, reverse=True):
        have = copies[step]
        if all(r in have for r in range(world)):
            folder = assemble(store.root / "recovered", step, world, have)
            return Recovery(folder, step, f"from the memory copies of step {step}")
    newest = max(copies, default=None)
    if newest is None:
        return Recovery(None, None, "no memory copy was complete")
    gone = sorted(r for r in range(world) if r not in copies[newest])
    return Recovery(
        None,
        None,
        f"rank(s) {', '.join(map(str, gone))} and their buddies were lost: no memory copy "
        f"of their pieces is left",
    )


def assemble(root: Path, step: int, world: int, have: dict[int, Path]) -> Path:
    """A checkpoint folder of ``step`` from each rank's copy (hard links) and the
    metadata merged from their indexes."""
    from plait.checkpoint.write import Snapshot, merge

    final = root / step_dirname(step)
    shutil.rmtree(final, ignore_errors=True)
    final.mkdir(parents=True)
    indexes: list[dict[str, Any]] = []
    for r in range(world):
        src = have[r]
        os.link(src / rank_filename(r), final / rank_filename(r))
        indexes.append(json.loads((src / index_name(r)).read_text("utf-8")))
    head = indexes[0]
    snap = Snapshot(step, 0, world, {}, head, head["header"], head["order"])
    (final / METADATA).write_bytes(json_bytes(merge(snap, indexes)))
    fsync_dir(final)
    return final


def store_from_env() -> MemoryStore:
    """The store of this job: the launcher's folder (:data:`STORE_ENV`), else one per
    torchrun job and node in ``/dev/shm`` (it outlives the workers the agent restarts)."""
    root = os.environ.get(STORE_ENV)
    if root is None:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() else Path(tempfile.gettempdir())
        root = str(base / f"plait-memory-{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}")
    return MemoryStore(Path(root))
