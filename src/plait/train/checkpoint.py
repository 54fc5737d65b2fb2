"""Sharded, atomic, resumable checkpoints of a :class:`~plait.train.trainer.Trainer`.

**Save** (every rank, at a step boundary): each rank describes the pieces it holds
(:func:`local_pieces`: ZeRO flat-shard segments, tensor-parallel blocks, a pipeline
stage's layers) and writes the ones no other rank writes (one replica of each) with their
optimizer state and its own RNG states into ``rank<r>.safetensors`` inside a temporary
folder, fsynced, plus a small index; rank 0 then merges the indexes into
``metadata.json`` (global shapes, pieces, sha256 of every file, config, layout, step,
schedule, loss scaler, sampler), fsyncs, renames the folder into place and only then
atomically replaces the ``latest`` pointer, and deletes checkpoints beyond
``train.keep_checkpoints``. A save killed at any point leaves the previous checkpoint and
``latest`` untouched (at worst a stale temporary folder, removed by the next save).

**Restore**: the weights are loaded into the full one-device model *before* it is
parallelized (plait always builds the full model and shards it, so every layout starts
from them exactly as from fresh weights; fp32 masters stay exact); after the optimizer
exists each rank reads the optimizer state of exactly its own pieces through
:class:`~plait.train.reshard.CheckpointReader`, whatever layout wrote them. Then the
step counters, loss scaler, sampler position and this rank's RNG states.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save as st_save
from torch import nn

from plait import comm
from plait.config import Config
from plait.mesh import Mesh
from plait.parallel.pipeline.engine import find_stages
from plait.parallel.tensor.layers import shard_info
from plait.train.checkpoint_meta import (
    FORMAT,
    LATEST,
    METADATA,
    VERSION,
    CheckpointError,
    ParamEntry,
    Piece,
    TPSplit,
    dtype_to_name,
    fsync_dir,
    json_bytes,
    list_steps,
    rank_filename,
    read_latest,
    replace_durable,
    rng_payload,
    sha256_bytes,
    step_dirname,
    write_durable,
)
from plait.train.faults import restart_count
from plait.train.reshard import (
    CheckpointReader,
    find_checkpoint,
    load_weights,
    load_weights_file,
    restore_rng,
)

if TYPE_CHECKING:
    from plait.train.trainer import Trainer

SaveHook = Callable[[str], None]
_save_hook: SaveHook | None = None
"""FOR TESTS ONLY: called after each durable stage of a save ("shard", "index",
"metadata", "renamed", "latest") so a test can kill the process there."""


def _stage(name: str) -> None:
    if _save_hook is not None:
        _save_hook(name)


@dataclass
class LocalPiece:
    """A piece of one parameter this rank holds, and where its optimizer state lives."""

    name: str
    shape: list[int]  # global shape
    tp: TPSplit | None
    start: int
    end: int
    value: torch.Tensor  # (end - start,) the values (fp32 master where one exists)
    opt_param: torch.Tensor  # the inner optimizer's key for this piece's state
    param_dtype: torch.dtype
    write: bool  # this rank is the one replica that writes it


def _tp_of(
    p: torch.Tensor, local_shape: tuple[int, ...], tp_index: int
) -> tuple[TPSplit | None, list[int], bool]:
    """(tp split, global shape, whether this tp rank writes) of a parameter."""
    info = shard_info(p)
    if info is None or info.dim is None:
        return None, list(local_shape), tp_index == 0
    split = TPSplit(info.dim, info.full, info.shards, info.replicas, info.block, tp_index)
    shape = list(local_shape)
    shape[info.dim] = info.full
    return split, shape, tp_index % info.replicas == 0


def local_pieces(trainer: Trainer) -> list[LocalPiece]:
    """Every parameter piece this rank's optimizer steps, in a fixed order."""
    mesh, opt = trainer.mesh, trainer.optimizer
    tp_index = mesh.index("tp")
    replica_first = mesh.index("cp") == 0
    out: list[LocalPiece] = []
    names = {id(p): n for n, p in trainer.base.named_parameters()}  # one-device names
    stages = find_stages(trainer.model)  # pp > 1: the tied matrix is written by stage 0
    skip = stages.tied if stages is not None and stages.pp_index > 0 else None
    if stages is not None and stages.tied is not None:  # the last stage's copy of the
        names[id(stages.tied)] = "tok_embeddings.weight"  # tied matrix: its one-device name
    zero = opt.zero
    if zero is not None:
        replica_first = replica_first and zero.replicate_group.index == 0
        for slot in opt.slots:
            u = slot.unit
            seg_of = {(s, e): seg for seg, s, e in slot.segments}
            for i, s, e in u.local_segments():
                seg = seg_of.get((s, e))
                if seg is None:
                    continue
                p = u.params[i]
                tp, shape, tp_write = _tp_of(p, tuple(u.shapes[i]), tp_index)
                a = u.lo + s - u.offsets[i]
                out.append(
                    LocalPiece(
                        names[id(p)],
                        shape,
                        tp,
                        a,
                        a + (e - s),
                        slot.master[s:e],
                        seg,
                        zero.param_dtype,
                        replica_first and tp_write and p is not skip,
                    )
                )
        return out
    replica_first = replica_first and mesh.index("dp") == 0
    mine = {id(p) for p in trainer.model.parameters()}  # pp > 1: this stage's only
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) not in mine:
                continue
            tp, shape, tp_write = _tp_of(p, tuple(p.shape), tp_index)
            out.append(
                LocalPiece(
                    names[id(p)],
                    shape,
                    tp,
                    0,
                    p.numel(),
                    p.detach().reshape(-1),
                    p,
                    p.dtype,
                    replica_first and tp_write and p is not skip,
                )
            )
    return out


# ---------------------------------------------------------------------------- save


def _rank_payload(trainer: Trainer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors and its index (pieces with global shapes, RNG scalars)."""
    rank = trainer.mesh.rank
    fname = rank_filename(rank)
    tensors, rng = rng_payload(trainer.device)
    params: dict[str, dict[str, Any]] = {}
    state = trainer.optimizer.state
    for lp in local_pieces(trainer):
        if not lp.write:
            continue
        tag = f"{lp.name}/{lp.start}"
        piece = Piece(fname, lp.start, lp.end, lp.tp, {"param": f"param/{tag}"})
        tensors[f"param/{tag}"] = lp.value.detach().to("cpu", copy=True)
        for k, v in state.get(lp.opt_param, {}).items():
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
                lp.shape, dtype_to_name(lp.value.dtype), dtype_to_name(lp.param_dtype)
            ).to_json(),
        )
        entry["pieces"].append(piece.to_json())
    index = {"rank": rank, "file": fname, "rng": rng, "keys": sorted(tensors), "params": params}
    return tensors, index


def _merge(trainer: Trainer, step: int, indexes: list[dict[str, Any]]) -> dict[str, Any]:
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
    rank_of = {n: i for i, (n, _) in enumerate(trainer.base.named_parameters())}
    params = {n: params[n] for n in sorted(params, key=lambda n: (rank_of.get(n, len(rank_of)), n))}
    cfg, mesh = trainer.cfg, trainer.mesh
    opt = trainer.optimizer
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "sched_step": trainer.sched_step,
        "optimizer": {
            "class": type(opt.inner).__name__,
            "steps": opt.steps,
            "skipped": opt.skipped,
            "scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
        },
        "sampler": {**trainer.sampler.state_dict(), "step": step},
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


def save_checkpoint(trainer: Trainer, root: str | Path, step: int, keep: int) -> Path:
    """Write the checkpoint of ``step`` (optimizer steps done) under ``root`` on every
    rank (collective); returns its folder. See the module docstring for the protocol."""
    mesh = trainer.mesh
    root = Path(root)
    final = root / step_dirname(step)
    tmp = root / f".tmp-{final.name}"
    if mesh.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier(mesh)
    tensors, index = _rank_payload(trainer)
    data = st_save(tensors)
    write_durable(tmp / index["file"], data)
    index["checksum"] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    _stage("shard")
    write_durable(tmp / f"rank{mesh.rank:05d}.json", json_bytes(index))
    _stage("index")
    _barrier(mesh)
    if mesh.rank == 0:
        parts = [tmp / f"rank{r:05d}.json" for r in range(mesh.world_size)]
        indexes = [json.loads(p.read_text("utf-8")) for p in parts]
        write_durable(tmp / METADATA, json_bytes(_merge(trainer, step, indexes)))
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
        prune(root, keep)
    _barrier(mesh)
    return final


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (never the one ``latest`` names)
    and stale temporary folders of interrupted saves; returns what was deleted."""
    latest = (root / LATEST).read_text("utf-8").strip() if (root / LATEST).is_file() else ""
    steps = list_steps(root)
    doomed = [p for _, p in steps[: max(0, len(steps) - keep)] if p.name != latest]
    doomed += [p for pat in (".tmp-*", ".old-*") for p in root.glob(pat) if p.is_dir()]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


# ---------------------------------------------------------------------------- restore


@torch.no_grad()
def restore_training_state(trainer: Trainer, reader: CheckpointReader) -> int:
    """Optimizer state of this rank's pieces, counters, scaler, sampler, RNG; returns
    the step to continue from."""
    meta = reader.meta
    opt = trainer.optimizer
    for lp in local_pieces(trainer):
        state: dict[str, torch.Tensor] = {}
        for kind in reader.kinds(lp.name):
            if kind == "param":
                continue
            vals = reader.read(lp.name, kind, lp.tp, lp.start, lp.end)
            state[kind] = vals.to(lp.opt_param.device).view(lp.opt_param.shape).clone()
        for s in reader.scalar_names(lp.name):
            v = reader.scalar(lp.name, s)
            if v is not None:
                state[s] = v.clone()
        if state:
            opt.inner.state[lp.opt_param] = state
    o = meta["optimizer"]
    opt.steps, opt.skipped = int(o["steps"]), int(o["skipped"])
    if opt.scaler is not None and o.get("scaler"):
        opt.scaler.load_state_dict(o["scaler"])
    trainer.sched_step = int(meta["sched_step"])
    trainer.sampler.load_state_dict(meta["sampler"])
    restore_rng(reader, trainer.mesh.rank, trainer.device)
    return reader.step


def check_start(cfg: Config, world: int) -> None:
    """Before any process starts: the resume / init-from sources exist, and the fault
    injection rank (tests) is in the world. Raises :class:`CheckpointError`."""
    t = cfg.train
    if t.fault_inject_step and not 0 <= t.fault_inject_rank < world:
        raise CheckpointError(
            f"train.fault_inject_rank = {t.fault_inject_rank} is not a rank of a world of "
            f"{world}; use 0..{world - 1}."
        )
    if t.resume in ("latest", "auto"):
        root = Path(t.checkpoint_dir or ".")
        if t.resume == "latest" and read_latest(root) is None and not list_steps(root):
            raise CheckpointError(
                f"--resume: there is no checkpoint in {root} (train.checkpoint_dir) yet; "
                "leave out --resume, or use --resume auto to start fresh when there is none."
            )
    elif t.resume and not Path(t.resume).exists():
        raise CheckpointError(f"train.resume: there is no checkpoint at {t.resume}.")
    if t.init_from and not Path(t.init_from).exists():
        raise CheckpointError(
            f"train.init_from: there is no weights file or checkpoint at {t.init_from}."
        )


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
        mode = t.resume
        if mode is None and self.root is not None and restart_count() > 0:
            mode = "auto"
        self.reader = find_checkpoint(mode, self.root, mesh.rank == 0) if mode else None
        self.init_from = t.init_from
        self.saved: list[Path] = []

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
        """Resumed or ``init_from`` weights into the full model, before parallelize."""
        if self.reader is not None:
            load_weights(model, self.reader.model_state(), str(self.reader.folder))
        elif self.init_from:
            load_weights(model, load_weights_file(self.init_from), self.init_from)

    def restore(self, trainer: Trainer) -> int:
        """Everything else once the optimizer exists; the step to continue from."""
        if self.reader is None:
            if self.init_from and trainer.is_main:
                trainer.progress.message(f"plait: started from the weights in {self.init_from}")
            return 0
        step = restore_training_state(trainer, self.reader)
        if trainer.is_main:
            how = f" (elastic restart {restart_count()})" if restart_count() else ""
            trainer.progress.message(
                f"plait: resumed from {self.reader.folder} at step {step}{how}"
            )
        self.reader = None  # free the cached tensors
        return step

    def after_step(self, trainer: Trainer, done: int, stop: bool) -> Path | None:
        """Save after ``done`` steps when due (every k, the last step, a stop request)."""
        if self.root is None:
            return None
        due = self.every > 0 and done % self.every == 0
        if not (due or stop or done == trainer.cfg.train.steps):
            return None
        path = save_checkpoint(trainer, self.root, done, self.keep)
        self.saved.append(path)
        return path
