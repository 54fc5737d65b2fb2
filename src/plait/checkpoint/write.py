"""Writing a checkpoint, in three phases a synchronous and an asynchronous save share.

1. :func:`snapshot` (every rank, at the step boundary, on the training thread): this
   rank's pieces, their optimizer state, its RNG and rank state copied to host memory,
   and (rank 0) the metadata's header: step counters, scaler, sampler, config, layout.
   After it returns training may change every tensor: nothing later reads ``ts``.
2. :func:`write_rank` (every rank): the safetensors file, fsynced, then this rank's
   index (its pieces and the file's sha256 and size), renamed into place.
3. :func:`commit` (rank 0): every rank's index present, every file the size its index
   records (complete), ``metadata.json`` merged and fsynced, the folder renamed into
   place, only then ``latest`` atomically replaced; then the retention rules.

:func:`save_checkpoint` runs them in order with an agreement (one all-gather of a flag)
after each, so a failure on any rank removes the temporary folder and raises
:class:`CheckpointSaveError` everywhere. :mod:`plait.checkpoint.write_async` runs phase 1
on the training thread and phases 2-3 on a writer thread.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait import comm
from plait.checkpoint.files import fsync_dir, replace_durable, write_durable, write_safetensors
from plait.checkpoint.folder import prune
from plait.checkpoint.format import (
    FORMAT,
    LATEST,
    METADATA,
    VERSION,
    CheckpointError,
    ParamEntry,
    Piece,
    dtype_to_name,
    folders,
    index_name,
    json_bytes,
    rank_filename,
    step_dirname,
)
from plait.checkpoint.rank_state import rank_state_tensors, rng_payload
from plait.checkpoint.state import TrainState
from plait.errors import PlaitError
from plait.mesh import Mesh

SaveHook = Callable[[str], None]
"""Called after each durable stage of a save ("shard", "index", "metadata", "renamed",
"latest"); tests use it (:attr:`Checkpointing.on_stage`) to kill a save midway."""


class CheckpointSaveError(PlaitError):
    """A save failed (disk full, folder gone); its temporary folder has been removed."""


@dataclass
class Snapshot:
    """One rank's part of a checkpoint, in host memory (phase 1's result)."""

    step: int
    rank: int
    world: int
    tensors: dict[str, torch.Tensor]
    """Every tensor of this rank's file, copies on the CPU."""
    index: dict[str, Any]
    """This rank's pieces and RNG scalars (``checksum`` is added once written)."""
    header: dict[str, Any] | None
    """Rank 0: ``metadata.json`` without the pieces, ranks and files."""
    order: dict[str, int]
    """Rank 0: each parameter's position in the one-device model (metadata order)."""


def snapshot(
    ts: TrainState, step: int, copy: bool = True, staging: dict[str, torch.Tensor] | None = None
) -> Snapshot:
    """Phase 1: copy this rank's state to host memory (see the module docstring).
    ``copy=False`` (a synchronous save: nothing changes the state until it is written)
    keeps tensors already on the CPU as they are instead of copying them. ``staging``
    (an asynchronous save): host buffers kept from the previous save, reused (pinned
    for a CUDA state), so a save copies into memory that is already mapped."""
    rank = ts.mesh.rank
    fname = rank_filename(rank)
    tensors, rng = rng_payload(ts.device)
    tensors.update(rank_state_tensors(ts.rank_state))
    cuda = False

    def host(key: str, t: torch.Tensor) -> torch.Tensor:
        nonlocal cuda
        if staging is None:
            return t.detach().to("cpu", copy=copy)
        buf = staging.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.device.type == "cuda"
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            staging[key] = buf
        cuda = cuda or t.device.type == "cuda"
        buf.copy_(t.detach(), non_blocking=True)
        return buf

    params: dict[str, dict[str, Any]] = {}
    state = ts.optimizer.inner.state
    for lp in ts.optimizer.local_pieces():
        if not lp.write:
            continue
        tag = f"{lp.name}/{lp.start}"
        piece = Piece(fname, lp.start, lp.end, lp.tp, {"param": f"param/{tag}"})
        tensors[f"param/{tag}"] = host(f"param/{tag}", lp.value)
        for k, v in state.get(lp.key, {}).items():
            if not isinstance(v, torch.Tensor):
                raise CheckpointError(f"optimizer state {k!r} of {lp.name} is not a tensor")
            if v.dim() == 0 or v.shape != lp.key.shape:  # whole-parameter state
                piece.scalars[k] = f"{k}/{tag}"
                tensors[f"{k}/{tag}"] = host(f"{k}/{tag}", v)
            else:
                piece.keys[k] = f"{k}/{tag}"
                tensors[f"{k}/{tag}"] = host(f"{k}/{tag}", v.reshape(-1))
        entry = params.setdefault(
            lp.name,
            ParamEntry(lp.shape, dtype_to_name(lp.value.dtype), dtype_to_name(lp.dtype)).to_json(),
        )
        entry["pieces"].append(piece.to_json())
    if cuda:
        torch.cuda.synchronize(ts.device)  # the non-blocking copies have landed
    index = {"rank": rank, "file": fname, "rng": rng, "keys": sorted(tensors), "params": params}
    header = _header(ts, step) if rank == 0 else None
    order = {n: i for i, n in enumerate(ts.model.param_names)} if rank == 0 else {}
    return Snapshot(step, rank, ts.mesh.world_size, tensors, index, header, order)


def _header(ts: TrainState, step: int) -> dict[str, Any]:
    """The metadata's layout-independent fields, as of now (the step boundary)."""
    cfg, mesh, opt = ts.config, ts.mesh, ts.optimizer
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
        "config": json.loads(json.dumps(dataclasses.asdict(cfg))),  # a deep copy
    }


def merge(snap: Snapshot, indexes: list[dict[str, Any]]) -> dict[str, Any]:
    """``metadata.json`` from the header and every rank's index (rank 0)."""
    assert snap.header is not None
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
    rank_of = snap.order
    params = {n: params[n] for n in sorted(params, key=lambda n: (rank_of.get(n, len(rank_of)), n))}
    return {
        **snap.header,
        "params": params,
        "ranks": [
            {"rank": ix["rank"], "file": ix["file"], "rng": ix["rng"], "keys": ix["keys"]}
            for ix in indexes
        ],
        "files": {ix["file"]: ix["checksum"] for ix in indexes},
    }


def open_folder(root: Path, tmp: Path) -> None:
    """Rank 0: a fresh temporary folder."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()


def write_rank(tmp: Path, snap: Snapshot, stage: SaveHook) -> None:
    """Phase 2: this rank's file, fsynced, then its index (renamed into place, so a
    reader never sees a partial index)."""
    digest, size = write_safetensors(tmp / snap.index["file"], snap.tensors)
    snap.index["checksum"] = {"sha256": digest, "bytes": size}
    stage("shard")
    part = tmp / f".{index_name(snap.rank)}.part"
    write_durable(part, json_bytes(snap.index))
    part.replace(tmp / index_name(snap.rank))
    stage("index")


def commit(
    root: Path,
    snap: Snapshot,
    keep: int,
    stage: SaveHook,
    protect: tuple[str, ...] = (),
    trusted: set[str] | None = None,
) -> Path:
    """Phase 3 (rank 0): check every rank's file is complete, merge the metadata, rename
    the folder into place, replace ``latest``, prune."""
    final, tmp = folders(root, snap.step)
    parts = [tmp / index_name(r) for r in range(snap.world)]
    indexes = [json.loads(p.read_text("utf-8")) for p in parts]
    for ix in indexes:  # verified: every file is there, as long as its writer wrote
        size = (tmp / ix["file"]).stat().st_size
        if size != ix["checksum"]["bytes"]:
            raise CheckpointError(
                f"checkpoint {final.name}: {ix['file']} has {size} bytes, its writer wrote "
                f"{ix['checksum']['bytes']}"
            )
    write_durable(tmp / METADATA, json_bytes(merge(snap, indexes)))
    for p in parts:
        p.unlink()
    fsync_dir(tmp)
    stage("metadata")
    old = root / f".old-{final.name}"
    if final.exists():  # the same step saved before (a rerun after a crash)
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    stage("renamed")
    replace_durable(root / LATEST, (final.name + "\n").encode())
    stage("latest")
    if trusted is not None:
        trusted.add(final.name)
    prune(root, keep, protect=(*protect, final.name), trusted=trusted)
    return final


def agree(mesh: Mesh, error: str | None) -> list[int]:
    """Collective: the ranks that report an error (``error`` not None on that rank), the
    same list on every rank (one all-gather of a flag, counted by plait.comm)."""
    flag = torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64)
    if mesh.world_size == 1:
        return [0] if error is not None else []
    out = comm.all_gather(flag.to(mesh.device), mesh.world())  # (world,)
    assert isinstance(out, torch.Tensor)
    return [r for r, f in enumerate(out.cpu().tolist()) if f > 0]


def save_error(root: Path, step: int, failed: list[int], why: str) -> CheckpointSaveError:
    return CheckpointSaveError(
        f"saving checkpoint {step_dirname(step)} into {root} failed on rank(s) "
        f"{', '.join(map(str, failed))}: {why}; the temporary folder was removed and "
        "the previous checkpoint is untouched"
    )


def os_error(e: BaseException, root: Path) -> str:
    if isinstance(e, OSError):
        return f"{e.strerror or e} ({e.filename or root})"
    return str(e)


def save_checkpoint(
    ts: TrainState,
    root: str | Path,
    step: int,
    keep: int,
    on_stage: SaveHook | None = None,
    *,
    protect: tuple[str, ...] = (),
    trusted: set[str] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` (optimizer steps done) under ``root`` on every
    rank (collective, synchronous); returns its folder. A failure on any rank (a full
    disk) removes the temporary folder and raises :class:`CheckpointSaveError` on every
    rank; the previous checkpoint stays. ``protect`` and ``trusted``: see
    :func:`~plait.checkpoint.folder.prune`."""
    mesh = ts.mesh
    root = Path(root)
    final, tmp = folders(root, step)

    def stage(name: str) -> None:
        if on_stage is not None:
            on_stage(name)

    def _step(work: Callable[[], Any], only_rank0: bool = False) -> None:
        err: str | None = None
        if not only_rank0 or mesh.rank == 0:
            try:
                work()
            except (OSError, CheckpointError) as e:
                err = os_error(e, root)
        failed = agree(mesh, err)
        if failed:
            if mesh.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise save_error(root, step, failed, err or f"see rank {failed[0]}")

    _step(lambda: open_folder(root, tmp), only_rank0=True)
    snap = snapshot(ts, step, copy=False)  # written before training changes anything
    _step(lambda: write_rank(tmp, snap, stage))
    _step(lambda: commit(root, snap, keep, stage, protect, trusted), only_rank0=True)
    return final
