"""Asynchronous checkpoint saves (``train.async_checkpoint = true``).

At a save the training thread only (1) waits for the previous save, if one is still in
flight, and learns collectively whether it succeeded (at most one save in flight), (2)
has rank 0 create the temporary folder (one agreement), and (3) copies this rank's state
to host memory (:func:`~plait.checkpoint.write.snapshot`). Training then
continues while a writer thread on every rank writes its file and index
(:func:`~plait.checkpoint.write.write_rank`); rank 0's writer waits until every
rank's index is in the folder (the index is renamed into place after its file is
fsynced: complete), then commits (:func:`~plait.checkpoint.write.commit`): the
metadata, the rename of the folder, and only then ``latest``.

The writer threads run no collectives (the training thread owns the process groups):
they coordinate through the checkpoint folder, which every rank already shares. A
writer that fails leaves ``rank<r>.error`` in the temporary folder; rank 0 then gives
the save up and removes the folder, and the next save (or the end of the run) raises
:class:`~plait.checkpoint.write.CheckpointSaveError` on every rank. A process
killed during the background write never reaches the rename: ``latest`` still names the
previous checkpoint, and the abandoned temporary folder is removed when the next run
takes the folder.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from pathlib import Path

import torch

from plait.checkpoint.format import CheckpointError, folders, index_name
from plait.checkpoint.state import TrainState
from plait.checkpoint.write import (
    SaveHook,
    Snapshot,
    agree,
    commit,
    open_folder,
    os_error,
    save_error,
    snapshot,
    write_rank,
)
from plait.mesh import Mesh

POLL_S = 0.002
"""Rank 0's writer looks for the other ranks' indexes this often."""


class AsyncSaver:
    """One rank's background checkpoint writer; at most one save in flight."""

    def __init__(self, mesh: Mesh, root: Path, keep: int) -> None:
        self.mesh, self.root, self.keep = mesh, root, keep
        self.thread: threading.Thread | None = None
        self.step = -1
        self.error: str | None = None
        self.cancel = threading.Event()
        self.staging: dict[str, torch.Tensor] = {}
        """Host buffers the state is copied into, reused from save to save (one copy of
        this rank's state; pinned for a CUDA state)."""
        self.events: list[tuple[str, int]] = []
        """``(what, step)`` in order: "snapshot" (training thread, state copied),
        "written" (this rank's file complete), "committed" (rank 0: ``latest`` replaced),
        "failed"; tests read it to see training steps run while a writer works."""

    def save(
        self,
        ts: TrainState,
        step: int,
        on_stage: SaveHook | None,
        protect: tuple[str, ...],
        trusted: set[str] | None,
    ) -> Path:
        """Collective, on the training thread: wait for the previous save, then copy
        the state to host memory and start writing it in the background."""
        self.wait()
        final, tmp = folders(self.root, step)
        err: str | None = None
        if self.mesh.rank == 0:
            try:
                open_folder(self.root, tmp)
            except OSError as e:
                err = os_error(e, self.root)
        failed = agree(self.mesh, err)
        if failed:
            raise save_error(self.root, step, failed, err or f"see rank {failed[0]}")
        snap = snapshot(ts, step, staging=self.staging)
        self.events.append(("snapshot", step))
        stage: SaveHook = on_stage if on_stage is not None else (lambda _: None)
        self.step = step
        self.thread = threading.Thread(
            target=self._write,
            args=(snap, tmp, stage, protect, trusted),
            name=f"plait-checkpoint-{step}",
            daemon=True,
        )
        self.thread.start()
        return final

    def _write(
        self,
        snap: Snapshot,
        tmp: Path,
        stage: SaveHook,
        protect: tuple[str, ...],
        trusted: set[str] | None,
    ) -> None:
        try:
            write_rank(tmp, snap, stage)
            self.events.append(("written", snap.step))
            if snap.rank == 0:
                self._await_ranks(tmp, snap.world)
                commit(self.root, snap, self.keep, stage, protect, trusted)
                self.events.append(("committed", snap.step))
        except (OSError, CheckpointError) as e:
            self.error = os_error(e, self.root)
            self.events.append(("failed", snap.step))
            self._abandon(tmp, snap.rank)

    def _await_ranks(self, tmp: Path, world: int) -> None:
        """Rank 0: until every rank's index is in ``tmp`` (or one reports an error)."""
        deadline = time.monotonic() + self.mesh.timeout_s
        missing = set(range(world))
        while missing:
            for r in sorted(missing):
                if (tmp / index_name(r)).exists():
                    missing.discard(r)
                elif (tmp / f"rank{r:05d}.error").exists():
                    why = (tmp / f"rank{r:05d}.error").read_text("utf-8", errors="replace")
                    raise CheckpointError(f"rank {r}'s writer failed: {why}")
            if not missing:
                return
            if self.cancel.is_set():
                raise CheckpointError("the run ended before every rank's file was written")
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"rank(s) {sorted(missing)} did not finish writing within "
                    f"{self.mesh.timeout_s:.0f} s"
                )
            time.sleep(POLL_S)

    def _abandon(self, tmp: Path, rank: int) -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            return
        with contextlib.suppress(OSError):  # tell rank 0's writer (the disk may be full)
            (tmp / f"rank{rank:05d}.error").write_text(self.error or "failed")

    def wait(self) -> None:
        """Collective: wait for the save in flight (if any); raises
        :class:`CheckpointSaveError` on every rank when it failed on any."""
        if self.thread is None:
            return
        self.thread.join()
        self.thread = None
        err, self.error = self.error, None
        failed = agree(self.mesh, err)
        if failed:
            raise save_error(self.root, self.step, failed, err or f"see rank {failed[0]}")

    def close(self) -> None:
        """Not collective (the run is ending, perhaps with an error): stop waiting for
        other ranks and let the writer finish or give up."""
        if self.thread is not None:
            self.cancel.set()
            self.thread.join()
            self.thread = None
