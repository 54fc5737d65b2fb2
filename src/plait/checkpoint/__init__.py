"""Sharded, atomic, resumable checkpoints of a :class:`TrainState`.

Checkpoint code names no parallelism: it sees the model and optimizer only through the
local-pieces protocol (:mod:`plait.pieces`, :mod:`plait.checkpoint.state`), and it
imports nothing from :mod:`plait.parallel` or :mod:`plait.train`.

**Save** (every rank, at a step boundary; :mod:`plait.checkpoint.write`): each rank
takes the pieces it holds from the optimizer (``local_pieces()``: one-device names,
global shapes, the tensor-parallel block, the flat element range, which rank writes)
and writes the ones it is the writer of with their optimizer state and its own RNG
states into ``rank<r>.safetensors`` inside a temporary folder, fsynced, plus a small
index; rank 0 then merges the indexes into ``metadata.json`` (global shapes, pieces,
sha256 of every file, config, layout, step, schedule, loss scaler, sampler; the format:
:mod:`plait.checkpoint.format`), fsyncs, renames the folder into place and only then
atomically replaces the ``latest`` pointer, and applies the retention rules (only
verified checkpoints count, the one the run resumed from and the newest verified one
are never deleted). A save killed at any point leaves the previous checkpoint and
``latest`` untouched (at worst a stale temporary folder, removed when the next run
takes the folder); a save that fails on any rank removes its temporary folder and
raises :class:`CheckpointSaveError` on every rank. With ``train.async_checkpoint`` the
state is copied to host memory and the files are written and committed by a background
writer (:mod:`plait.checkpoint.write_async`). Rank 0 holds the folder's lock for the
whole run, and prunes it (:mod:`plait.checkpoint.folder`).

**Restore** (:mod:`plait.checkpoint.load`): before parallelize only the tensor names
and shapes are checked against the model; once the model is sharded and the optimizer
exists, each rank reads exactly the byte ranges of the pieces it holds (its weights into
the masters and the model's storage, and their optimizer state), whatever layout wrote
them (:mod:`plait.checkpoint.read`), after the files' checksums were verified once per
file per host (:mod:`plait.checkpoint.files`). Then the step counters, loss scaler,
sampler position and this rank's RNG states (:mod:`plait.checkpoint.rank_state`).
``train.init_from`` (a checkpoint folder, a consolidated file or a Hugging Face model
folder) is read the same way, weights only.

**Hugging Face** (:mod:`plait.checkpoint.hf`: ``config.json`` <-> ``ModelConfig`` and
the name map; :mod:`plait.checkpoint.hf_read`: a Hugging Face folder read rank-locally;
:mod:`plait.checkpoint.hf_export`: any checkpoint written as a Hugging Face folder,
streaming): :func:`pretrained_config`, :func:`open_hf`, :func:`load_hf_weights`,
:func:`export_hf`. Which checkpoint a run resumes from, and the checks before any process
trains: :mod:`plait.checkpoint.resume`.

The names below are the package's surface: code outside it imports them from
``plait.checkpoint``. :class:`Checkpointing` is what the trainer uses;
:func:`save_checkpoint`, :func:`find_checkpoint` and :func:`restore_training_state` are
the same steps for one's own loop; :class:`CheckpointReader`, :func:`consolidate` and
:func:`check_start` serve the CLI and the launchers.
"""

from __future__ import annotations

from plait.checkpoint.files import verify_collective
from plait.checkpoint.folder import CheckpointLockedError, FolderLock
from plait.checkpoint.format import (
    CheckpointError,
    CorruptCheckpointError,
    read_latest,
    step_dirname,
)
from plait.checkpoint.hf import (
    hf_to_plait,
    plait_to_hf,
    pretrained_config,
)
from plait.checkpoint.hf_export import DEFAULT_SHARD_SIZE, export_hf
from plait.checkpoint.hf_read import is_hf_folder, load_hf_weights, open_hf
from plait.checkpoint.load import restore_training_state
from plait.checkpoint.manager import Checkpointing
from plait.checkpoint.read import CheckpointReader, consolidate
from plait.checkpoint.resume import check_start, find_checkpoint, finished_step
from plait.checkpoint.state import TrainState
from plait.checkpoint.write import CheckpointSaveError, save_checkpoint
from plait.checkpoint.write_async import AsyncSaver

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "AsyncSaver",
    "CheckpointError",
    "CheckpointLockedError",
    "CheckpointReader",
    "CheckpointSaveError",
    "Checkpointing",
    "CorruptCheckpointError",
    "FolderLock",
    "TrainState",
    "check_start",
    "consolidate",
    "export_hf",
    "find_checkpoint",
    "finished_step",
    "hf_to_plait",
    "is_hf_folder",
    "load_hf_weights",
    "open_hf",
    "plait_to_hf",
    "pretrained_config",
    "read_latest",
    "restore_training_state",
    "save_checkpoint",
    "step_dirname",
    "verify_collective",
]
