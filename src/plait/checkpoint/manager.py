"""The trainer's checkpoint hooks: what a run starts from, and when it saves.

:class:`Checkpointing` ties the package together for the training loop: rank 0 takes the
folder (:mod:`plait.checkpoint.folder`), the run finds what it resumes from
(:mod:`plait.checkpoint.resume`) or the ``init_from`` weights, checks them against the
model before it is sharded and loads each rank's pieces after
(:mod:`plait.checkpoint.load`), and saves when due, synchronously
(:mod:`plait.checkpoint.write`) or in the background
(:mod:`plait.checkpoint.write_async`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from plait.checkpoint.files import verify_collective
from plait.checkpoint.folder import FolderLock, remove_temporaries
from plait.checkpoint.format import CheckpointError
from plait.checkpoint.load import check_model, load_pieces, open_weights, restore_training_state
from plait.checkpoint.memory_copy import CopyReport, memory_copy
from plait.checkpoint.memory_store import STORE_ENV, MemoryStore, store_from_env
from plait.checkpoint.peft_io import is_lora_name
from plait.checkpoint.read import CheckpointReader
from plait.checkpoint.resume import find_checkpoint
from plait.checkpoint.state import TrainState
from plait.checkpoint.write import SaveHook, agree, save_checkpoint
from plait.checkpoint.write_async import AsyncSaver
from plait.config import Config
from plait.config.rules.elastic import check_memory_checkpoints
from plait.mesh import Mesh


class Checkpointing:
    """The trainer's checkpoint hooks: what to start from, and when to save.

    Resumes per ``train.resume`` (a job restarted by torchrun's elastic agent,
    ``restarts`` > 0, resumes as "auto" by itself) or starts from ``train.init_from``
    weights; saves every ``train.checkpoint_every`` steps, at the end of the run and when
    asked to stop. ``restarts``: how many times the job was restarted (the trainer passes
    :func:`plait.train.faults.restart_count`).
    """

    def __init__(self, cfg: Config, mesh: Mesh, restarts: int = 0) -> None:
        t = cfg.train
        self.root = Path(t.checkpoint_dir) if t.checkpoint_dir else None
        self.every = 0 if t.checkpoint_every == "auto" else t.checkpoint_every
        """Steps between disk saves (0: none; 'auto' is 0 until measured, see
        :mod:`plait.train.intervals`)."""
        self.keep = t.keep_checkpoints
        m = t.memory_checkpoint_every
        check_memory_checkpoints(m, mesh.world_size)
        self.memory_every = 0 if m == "auto" else m
        """Steps between memory copies (0: none, or 'auto' until measured)."""
        self.store: MemoryStore | None = store_from_env() if m != 0 else None
        """Where the memory copies live (``train.memory_checkpoint_every``)."""
        self.per_node = int(os.environ.get("LOCAL_WORLD_SIZE", mesh.world_size))
        self.copies: list[CopyReport] = []
        self.mesh = mesh
        self.restarts = restarts
        self.lock: FolderLock | None = None
        if self.root is not None:
            self._take_folder(self.root)
        mode = t.resume
        if mode is None and self.root is not None and restarts > 0:
            mode = "auto"
        self.load_report: dict[str, Any] = {"hashed": [], "bytes_read": 0}
        """What this rank read to start: the files it checksummed (once per file per
        host) and the tensor bytes of its pieces (tests check it against the pieces)."""

        def verify(folder: Path, meta: dict[str, Any]) -> None:
            self.load_report["hashed"] = verify_collective(folder, meta, mesh)

        self.reader = find_checkpoint(mode, self.root, mesh.rank == 0, verify) if mode else None
        self.resumed_from: str | None = None
        """Name of the checkpoint folder the run resumed from (retention keeps it)."""
        self.trusted: set[str] = set()
        """Checkpoint folders known verified (each is hashed at most once per run)."""
        if self.reader is not None:
            self.trusted.add(self.reader.folder.name)
            if self.root is not None and self.reader.folder.parent.resolve() == self.root.resolve():
                self.resumed_from = self.reader.folder.name
        self.init_from = t.init_from
        self.lora = cfg.lora.enabled
        """LoRA adapters are attached (their factors may be absent from init_from)."""
        self.weights: CheckpointReader | None = None
        """``init_from``'s weights (a checkpoint folder, a consolidated file or a Hugging
        Face model folder)."""
        if self.reader is None and t.init_from:
            self.weights = open_weights(t.init_from, mesh, cfg.model.family)
        self.steps = t.steps
        self.saved: list[Path] = []
        self.on_stage: SaveHook | None = None
        """Called after each durable stage of every save (tests kill a save midway)."""
        self.writer: AsyncSaver | None = None
        """The background writer (``train.async_checkpoint``)."""
        if self.root is not None and t.async_checkpoint:
            self.writer = AsyncSaver(mesh, self.root, self.keep)

    def _take_folder(self, root: Path) -> None:
        """Rank 0 takes the folder's lock and removes abandoned temporaries; every rank
        learns whether it could (a refusal is raised on every rank, before training)."""
        err: CheckpointError | None = None
        if self.mesh.rank == 0:
            lock = FolderLock(root)
            try:
                lock.acquire()
                self.lock = lock
                remove_temporaries(root)
            except CheckpointError as e:
                err = e
            except OSError as e:
                err = CheckpointError(f"train.checkpoint_dir {root}: {e.strerror or e}")
        if agree(self.mesh, None if err is None else str(err)):
            self.close()
            raise err or CheckpointError(
                f"checkpoint folder {root} could not be taken by rank 0 (see its error)"
            )

    def finish(self) -> None:
        """Collective, at the end of the loop: wait for an asynchronous save in flight
        (:class:`CheckpointSaveError` on every rank if it failed). The memory copies of a
        run that no launcher owns (torchrun's) are removed by each node's first rank."""
        if self.writer is not None:
            self.writer.wait()
        first_here = int(os.environ.get("LOCAL_RANK", "0")) == 0
        if self.store is not None and STORE_ENV not in os.environ and first_here:
            shutil.rmtree(self.store.root, ignore_errors=True)

    def close(self) -> None:
        """Release the folder's lock (rank 0; at the end of the run or when it fails),
        after the background writer, if any, has finished or given up."""
        if self.writer is not None:
            self.writer.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    @property
    def resume_step(self) -> int:
        """The step the run resumes from (0: a fresh start)."""
        return self.reader.step if self.reader is not None else 0

    @property
    def source(self) -> str | None:
        """The checkpoint folder or weights file the run starts from (None: fresh)."""
        if self.reader is not None:
            return str(self.reader.folder)
        return self.init_from

    def load_weights(self, model: nn.Module) -> None:
        """Check, before parallelize, that the resumed or ``init_from`` tensors match the
        full model by name and shape (no tensor data is read here: every rank reads its
        own pieces in :meth:`restore`)."""
        reader = self.reader or self.weights
        if reader is not None:  # (the adapters are attached later, by parallelize)
            lora = self.lora
            shapes = {
                n: list(e.shape) for n, e in reader.params.items() if not (lora and is_lora_name(n))
            }
            check_model(shapes, model, self.source or str(reader.folder))

    def restore(self, ts: TrainState, say: Callable[[str], None] | None = None) -> int:
        """Everything else once the optimizer exists; the step to continue from. ``say``
        (rank 0's progress messages) hears where the run started from."""
        if self.reader is None:
            if self.weights is not None:
                absent = is_lora_name if self.lora else None  # new adapters: their init
                load_pieces(ts, self.weights, optimizer_state=False, absent_ok=absent)
                self.load_report["bytes_read"] = self.weights.bytes_read
                self.weights.close()
                self.weights = None
            if self.init_from and say is not None:
                say(f"plait: started from the weights in {self.init_from}")
            return 0
        step = restore_training_state(ts, self.reader)
        if say is not None:
            how = f" (elastic restart {self.restarts})" if self.restarts else ""
            say(f"plait: resumed from {self.reader.folder} at step {step}{how}")
            before = self.reader.meta.get("config", {}).get("train", {}).get("steps")
            if isinstance(before, int) and before != self.steps:
                say(
                    f"plait: warning: the checkpoint's run had train.steps = {before}, this "
                    f"run has {self.steps}: the learning-rate schedule (warm-up, cosine "
                    "decay to the last step) changes from here on"
                )
        self.load_report["bytes_read"] = self.reader.bytes_read
        self.reader.close()
        self.reader = None  # free the open files
        return step

    def copy_to_memory(self, ts: TrainState, done: int) -> CopyReport:
        """Collective: the memory copy of step ``done`` (:mod:`plait.checkpoint.memory_copy`)."""
        assert self.store is not None
        report = memory_copy(ts, done, self.store, self.per_node)
        self.copies.append(report)
        return report

    def after_step(self, ts: TrainState, done: int, last: int, stop: bool) -> Path | None:
        """Save after ``done`` steps when due (every k, the ``last`` step, a stop request);
        copy to memory every ``memory_every`` steps before the last."""
        copy = self.store is not None and self.memory_every and done % self.memory_every == 0
        if copy and done < last and not stop:
            self.copy_to_memory(ts, done)
        if self.root is None:
            return None
        due = self.every > 0 and done % self.every == 0
        if not (due or stop or done == last):
            return None
        return self.save_now(ts, done)

    def save_now(self, ts: TrainState, done: int) -> Path:
        """Collective: save the checkpoint of step ``done`` (in the background with
        ``train.async_checkpoint``); returns its folder."""
        assert self.root is not None
        protect = (self.resumed_from,) if self.resumed_from else ()
        if self.writer is not None:
            path = self.writer.save(ts, done, self.on_stage, protect, self.trusted)
            self.saved.append(path)
            return path
        path = save_checkpoint(
            ts, self.root, done, self.keep, self.on_stage, protect=protect, trusted=self.trusted
        )
        self.saved.append(path)
        return path
