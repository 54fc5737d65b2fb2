"""Sharded, atomic, resumable checkpoints of a :class:`~plait.train.state.TrainState`.

Checkpoint code names no parallelism: it sees the model and optimizer only through the
local-pieces protocol (:mod:`plait.pieces`, :mod:`plait.train.state`).

**Save** (every rank, at a step boundary): each rank takes the pieces it holds from the
optimizer (``local_pieces()``: one-device names, global shapes, the tensor-parallel
block, the flat element range, which rank writes) and writes the ones it is the writer
of with their optimizer state and its own RNG states into ``rank<r>.safetensors``
inside a temporary folder, fsynced, plus a small index; rank 0 then merges the indexes into
``metadata.json`` (global shapes, pieces, sha256 of every file, config, layout, step,
schedule, loss scaler, sampler), fsyncs, renames the folder into place and only then
atomically replaces the ``latest`` pointer, and applies the retention rules
(:mod:`plait.train.checkpoint_retention`: only verified checkpoints count, the one the
run resumed from and the newest verified one are never deleted). A save killed at any
point leaves the previous checkpoint and ``latest`` untouched (at worst a stale
temporary folder, removed when the next run takes the folder); a save that fails on any
rank removes its temporary folder and raises :class:`CheckpointSaveError` on every rank.
Rank 0 holds the folder's lock for the whole run (:mod:`plait.train.checkpoint_lock`).

**Restore**: the weights are loaded into the full one-device model *before* it is
parallelized (plait always builds the full model and shards it, so every layout starts
from them exactly as from fresh weights; fp32 masters stay exact); after the optimizer
exists each rank reads the optimizer state of exactly its own pieces through
:class:`~plait.train.reshard.CheckpointReader`, whatever layout wrote them. Then the
step counters, loss scaler, sampler position and this rank's RNG states.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save
from torch import nn

from plait import comm
from plait.config import Config
from plait.errors import PlaitError
from plait.mesh import Mesh
from plait.train.checkpoint_io import verify_collective
from plait.train.checkpoint_load import load_pieces
from plait.train.checkpoint_lock import FolderLock, remove_temporaries
from plait.train.checkpoint_meta import (
    FORMAT,
    LATEST,
    METADATA,
    VERSION,
    CheckpointError,
    ParamEntry,
    Piece,
    dtype_to_name,
    fsync_dir,
    json_bytes,
    rank_filename,
    replace_durable,
    rng_payload,
    sha256_bytes,
    step_dirname,
    write_durable,
)
from plait.train.checkpoint_retention import prune
from plait.train.checkpoint_start import check_start as check_start
from plait.train.faults import restart_count
from plait.train.rank_state import rank_state_tensors, restore_rank_state
from plait.train.reshard import (
    CheckpointReader,
    check_model,
    find_checkpoint,
    restore_rng,
)
from plait.train.state import TrainState

SaveHook = Callable[[str], None]
"""Called after each durable stage of a save ("shard", "index", "metadata", "renamed",
"latest"); tests use it (:attr:`Checkpointing.on_stage`) to kill a save midway."""


# ---------------------------------------------------------------------------- save


def _rank_payload(ts: TrainState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors and its index (pieces with global shapes, RNG scalars)."""
    rank = ts.mesh.rank
    fname = rank_filename(rank)
    tensors, rng = rng_payload(ts.device)
    tensors.update(rank_state_tensors(ts.rank_state))
    params: dict[str, dict[str, Any]] = {}
    state = ts.optimizer.inner.state
    for lp in ts.optimizer.local_pieces():
        if not lp.write:
            continue
        tag = f"{lp.name}/{lp.start}"
        piece = Piece(fname, lp.start, lp.end, lp.tp, {"param": f"param/{tag}"})
        tensors[f"param/{tag}"] = lp.value.detach().to("cpu", copy=True)
        for k, v in state.get(lp.key, {}).items():
            if not isinstance(v, torch.Tensor):
                raise CheckpointError(f"optimizer state {k!r} of {lp.name} is not a tensor")
            if v.dim() == 0:
                piece.scalars[k] = f"{k}/{tag}"
                tensors[f"{k}/{tag}"] = v.detach().to("cpu", copy=True)
            else:
                piece.keys[k] = f"{k}/{tag}"
                tensors[f"{k}/{tag}"] = v.detach().reshape(-1).to("cpu", copy=True)
        entry = params.setdefault(
            lp.name,
            ParamEntry(
                lp.shape, dtype_to_name(lp.value.dtype), dtype_to_name(lp.dtype)
            ).to_json(),
        )
        entry["pieces"].append(piece.to_json())
    index = {"rank": rank, "file": fname, "rng": rng, "keys": sorted(tensors), "params": params}
    return tensors, index


def _merge(ts: TrainState, step: int, indexes: list[dict[str, Any]]) -> dict[str, Any]:
    """``metadata.json`` from every rank's index (rank 0)."""
    params: dict[str, dict[str, Any]] = {}
    for ix in indexes:
        for name, e in ix["params"].items():
            have = params.get(name)
            if have is None:
                params[name] = e
                continue
            if have["shape"] != e["shape"] or have["dtype"] != e["dtype"]:
                raise CheckpointError(
                    f"ranks disagree about tensor {name!r}: {have['shape']} {have['dtype']} "
                    f"vs {e['shape']} {e['dtype']}"
                )
            have["pieces"].extend(e["pieces"])
    rank_of = {n: i for i, n in enumerate(ts.model.param_names)}
    params = {n: params[n] for n in sorted(params, key=lambda n: (rank_of.get(n, len(rank_of)), n))}
    cfg, mesh = ts.config, ts.mesh
    opt = ts.optimizer
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "sched_step": ts.sched_step,
        "optimizer": {
            "class": type(opt.inner).__name__,
            "steps": opt.steps,
            "skipped": opt.skipped,
            "scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
        },
        "sampler": {**ts.sampler.state_dict(), "step": step},
        "layout": {
            "world_size": mesh.world_size,
            **{a: mesh.size(a) for a in ("dp", "tp", "pp", "cp")},
            "zero": cfg.parallel.zero,
            "zero_shard_size": cfg.parallel.zero_shard_size,
            "dtype": cfg.precision.dtype,
        },
        "config": dataclasses.asdict(cfg),
        "params": params,
        "ranks": [
            {"rank": ix["rank"], "file": ix["file"], "rng": ix["rng"], "keys": ix["keys"]}
            for ix in indexes
        ],
        "files": {ix["file"]: ix["checksum"] for ix in indexes},
    }


def _barrier(mesh: Mesh) -> None:
    if mesh.world_size > 1:
        comm.barrier(mesh.world())


def agree(mesh: Mesh, error: str | None) -> list[int]:
    """Collective: the ranks that report an error (``error`` not None on that rank), the
    same list on every rank (one all-gather of a flag, counted by plait.comm)."""
    flag = torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64)
    if mesh.world_size == 1:
        return [0] if error is not None else []
    out = comm.all_gather(flag.to(mesh.device), mesh.world())  # (world,)
    assert isinstance(out, torch.Tensor)
    return [r for r, f in enumerate(out.cpu().tolist()) if f > 0]


class CheckpointSaveError(PlaitError):
    """A save failed (disk full, folder gone); its temporary folder has been removed."""


def save_checkpoint(
    ts: TrainState, root: str | Path, step: int, keep: int, on_stage: SaveHook | None = None,
    *, protect: tuple[str, ...] = (), trusted: set[str] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` (optimizer steps done) under ``root`` on every
    rank (collective); returns its folder. See the module docstring for the protocol.
    A failure on any rank (a full disk) removes the temporary folder and raises
    :class:`CheckpointSaveError` on every rank; the previous checkpoint stays.
    ``protect`` and ``trusted``: see :func:`~plait.train.checkpoint_retention.prune`."""
    mesh = ts.mesh

    def _stage(name: str) -> None:
        if on_stage is not None:
            on_stage(name)

    root = Path(root)
    final = root / step_dirname(step)
    tmp = root / f".tmp-{final.name}"

    def _step(work: Callable[[], None], only_rank0: bool = False) -> None:
        err: str | None = None
        if not only_rank0 or mesh.rank == 0:
            try:
                work()
            except OSError as e:
                err = f"{e.strerror or e} ({e.filename or root})"
        failed = agree(mesh, err)
        if failed:
            if mesh.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            why = err or f"see rank {failed[0]}"
            raise CheckpointSaveError(
                f"saving checkpoint {final.name} into {root} failed on rank(s) "
                f"{', '.join(map(str, failed))}: {why}; the temporary folder was removed and "
                "the previous checkpoint is untouched"
            )

    def _open() -> None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    def _write() -> None:
        tensors, index = _rank_payload(ts)
        data = st_save(tensors)
        write_durable(tmp / index["file"], data)
        index["checksum"] = {"sha256": sha256_bytes(data), "bytes": len(data)}
        _stage("shard")
        write_durable(tmp / f"rank{mesh.rank:05d}.json", json_bytes(index))
        _stage("index")

    def _commit() -> None:
        parts = [tmp / f"rank{r:05d}.json" for r in range(mesh.world_size)]
        indexes = [json.loads(p.read_text("utf-8")) for p in parts]
        write_durable(tmp / METADATA, json_bytes(_merge(ts, step, indexes)))
        for p in parts:
            p.unlink()
        fsync_dir(tmp)
        _stage("metadata")
        old = root / f".old-{final.name}"
        if final.exists():  # the same step saved before (a rerun after a crash)
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
        _stage("renamed")
        replace_durable(root / LATEST, (final.name + "\n").encode())
        _stage("latest")
        if trusted is not None:
            trusted.add(final.name)
        prune(root, keep, protect=(*protect, final.name), trusted=trusted)

    _step(_open, only_rank0=True)
    _step(_write)
    _step(_commit, only_rank0=True)
    return final


# ---------------------------------------------------------------------------- restore


@torch.no_grad()
def restore_training_state(ts: TrainState, reader: CheckpointReader) -> int:
    """This rank's pieces (weights and optimizer state, :mod:`plait.train.checkpoint_load`),
    counters, scaler, sampler, RNG; returns the step to continue from."""
    meta = reader.meta
    opt = ts.optimizer
    load_pieces(ts, reader)
    o = meta["optimizer"]
    opt.steps, opt.skipped = int(o["steps"]), int(o["skipped"])
    if opt.scaler is not None and o.get("scaler"):
        opt.scaler.load_state_dict(o["scaler"])
    ts.sched_step = int(meta["sched_step"])
    ts.sampler.load_state_dict(meta["sampler"])
    restore_rng(reader, ts.mesh.rank, ts.device)
    restore_rank_state(ts.rank_state, meta, ts.mesh.rank, reader.tensor)
    return reader.step


def open_weights(path: str, mesh: Mesh) -> CheckpointReader:
    """``train.init_from``: a checkpoint folder (its files verified once per host) or a
    consolidated safetensors file, opened for rank-local reads."""
    p = Path(path)
    if p.is_dir():
        reader = CheckpointReader(p, verify=False)
        verify_collective(p, reader.meta, mesh)
        return reader
    if not p.is_file():
        raise CheckpointError(f"no checkpoint or weights file at {p}")
    return CheckpointReader.from_weights_file(p)


class Checkpointing:
    """The trainer's checkpoint hooks: what to start from, and when to save.

    Resumes per ``train.resume`` (a job restarted by torchrun's elastic agent resumes as
    "auto" by itself) or starts from ``train.init_from`` weights; saves every
    ``train.checkpoint_every`` steps, at the end of the run and when asked to stop.
    """

    def __init__(self, cfg: Config, mesh: Mesh) -> None:
        t = cfg.train
        self.root = Path(t.checkpoint_dir) if t.checkpoint_dir else None
        self.every, self.keep = t.checkpoint_every, t.keep_checkpoints
        self.mesh = mesh
        self.lock: FolderLock | None = None
        if self.root is not None:
            self._take_folder(self.root)
        mode = t.resume
        if mode is None and self.root is not None and restart_count() > 0:
            mode = "auto"
        verify = functools.partial(verify_collective, mesh=mesh)  # once per file per host
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
        self.weights: CheckpointReader | None = None
        """``init_from``'s weights (a checkpoint folder or a consolidated file)."""
        if self.reader is None and t.init_from:
            self.weights = open_weights(t.init_from, mesh)
        self.steps = t.steps
        self.saved: list[Path] = []
        self.on_stage: SaveHook | None = None
        """Called after each durable stage of every save (tests kill a save midway)."""

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

    def close(self) -> None:
        """Release the folder's lock (rank 0; at the end of the run or when it fails)."""
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
        if reader is not None:
            shapes = {n: list(e.shape) for n, e in reader.params.items()}
            check_model(shapes, model, self.source or str(reader.folder))

    def restore(self, ts: TrainState, say: Callable[[str], None] | None = None) -> int:
        """Everything else once the optimizer exists; the step to continue from. ``say``
        (rank 0's progress messages) hears where the run started from."""
        if self.reader is None:
            if self.weights is not None:
                load_pieces(ts, self.weights, optimizer_state=False)
                self.weights.close()
                self.weights = None
            if self.init_from and say is not None:
                say(f"plait: started from the weights in {self.init_from}")
            return 0
        step = restore_training_state(ts, self.reader)
        if say is not None:
            how = f" (elastic restart {restart_count()})" if restart_count() else ""
            say(f"plait: resumed from {self.reader.folder} at step {step}{how}")
            before = self.reader.meta.get("config", {}).get("train", {}).get("steps")
            if isinstance(before, int) and before != self.steps:
                say(
                    f"plait: warning: the checkpoint's run had train.steps = {before}, this "
                    f"run has {self.steps}: the learning-rate schedule (warm-up, cosine "
                    "decay to the last step) changes from here on"
                )
        self.reader.close()
        self.reader = None  # free the open files
        return step

    def after_step(self, ts: TrainState, done: int, last: int, stop: bool) -> Path | None:
        """Save after ``done`` steps when due (every k, the ``last`` step, a stop request)."""
        if self.root is None:
            return None
        due = self.every > 0 and done % self.every == 0
        if not (due or stop or done == last):
            return None
        protect = (self.resumed_from,) if self.resumed_from else ()
        path = save_checkpoint(
            ts, self.root, done, self.keep, self.on_stage, protect=protect, trusted=self.trusted
        )
        self.saved.append(path)
        return path
