"""Which checkpoint a run starts from, and what is checked before any process trains.

:func:`check_start` runs in the ``plait train`` process before it starts ranks (and on
each rank under torchrun): the resume / init-from sources exist, the checkpoint folder
is not held by another job, it is writable and has room for one checkpoint plus a margin,
and a resume would not change the data order (seed, global batch). :func:`finished_step`
tells a re-submitted finished run that there is nothing left to do.

:func:`find_checkpoint` opens the checkpoint a resume reads, verified: what ``latest``
names, or, when that one is missing or corrupt, the newest usable older one (with a
warning).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plait.arch import param_count
from plait.checkpoint.folder import (
    CheckpointLockedError,
    check_folder,
    describe_holder,
    lock_holder,
)
from plait.checkpoint.format import (
    LATEST,
    METADATA,
    CheckpointError,
    list_steps,
    read_latest,
    read_metadata,
)
from plait.checkpoint.read import CheckpointReader
from plait.config import Config

BYTES_PER_PARAM = 12
"""Bytes a checkpoint stores per parameter: fp32 values (masters where they exist) and
AdamW's two fp32 moments."""


def checkpoint_bytes(cfg: Config) -> int:
    """About how many bytes one checkpoint of ``cfg``'s model takes (all ranks together)."""
    return BYTES_PER_PARAM * param_count(cfg.model)


def _newest_meta(root: Path) -> dict[str, Any] | None:
    """The metadata of the checkpoint a resume of ``root`` would try first (unverified)."""
    pointed = read_latest(root)
    folders = [pointed] if pointed is not None else []
    folders += [p for _, p in reversed(list_steps(root))]
    for folder in folders:
        try:
            return read_metadata(folder)
        except CheckpointError:
            continue
    return None


def resume_root(cfg: Config) -> Path | None:
    """The checkpoint root a ``latest``/``auto`` resume reads (None: no such resume)."""
    t = cfg.train
    if t.resume in ("latest", "auto"):
        return Path(t.checkpoint_dir or ".")
    return None


def finished_step(cfg: Config) -> int | None:
    """The step of the newest checkpoint when a ``latest``/``auto`` resume finds one at
    or beyond ``train.steps`` (the run is already complete), else None."""
    root = resume_root(cfg)
    meta = _newest_meta(root) if root is not None else None
    if meta is None:
        return None
    step = int(meta.get("step", 0))
    return step if step >= cfg.train.steps else None


def check_resume_matches(cfg: Config, meta: dict[str, Any], source: str) -> None:
    """Refuse a resume that would change the data order: another seed or global batch."""
    sampler = meta.get("sampler", {})
    for key, have in (("seed", cfg.train.seed), ("global_batch", cfg.train.global_batch)):
        if key in sampler and sampler[key] != have:
            raise CheckpointError(
                f"cannot resume from {source}: it was written with train.{key} = "
                f"{sampler[key]}, this run has train.{key} = {have}; the data order would "
                f"change. Use train.{key} = {sampler[key]}, or start a new run without "
                "--resume (train.init_from keeps the weights)."
            )


def check_start(cfg: Config, probe_lock: bool = True) -> None:
    """Before any process trains; raises :class:`CheckpointError` (exit 2): sources
    exist, the folder is free (``probe_lock``), writable and roomy, and a resume keeps
    the seed and global batch."""
    t = cfg.train
    root = resume_root(cfg)
    if root is not None:
        if t.resume == "latest" and read_latest(root) is None and not list_steps(root):
            raise CheckpointError(
                f"--resume: there is no checkpoint in {root} (train.checkpoint_dir) yet; "
                "leave out --resume, or use --resume auto to start fresh when there is none."
            )
        meta = _newest_meta(root)
        if meta is not None:
            check_resume_matches(cfg, meta, str(root))
    elif t.resume and not Path(t.resume).exists():
        raise CheckpointError(f"train.resume: there is no checkpoint at {t.resume}.")
    elif t.resume and (Path(t.resume) / "metadata.json").is_file():
        check_resume_matches(cfg, read_metadata(Path(t.resume)), t.resume)
    if t.init_from and not Path(t.init_from).exists():
        raise CheckpointError(
            f"train.init_from: there is no weights file or checkpoint at {t.init_from}."
        )
    if t.checkpoint_dir:
        if probe_lock:
            holder = lock_holder(t.checkpoint_dir)
            if holder is not None:
                raise CheckpointLockedError(
                    f"checkpoint folder {t.checkpoint_dir} is in use by another job: "
                    f"{describe_holder(holder)}; wait for it to finish, stop it, or give this "
                    "run another train.checkpoint_dir"
                )
        check_folder(t.checkpoint_dir, checkpoint_bytes(cfg))


def find_checkpoint(
    spec: str,
    root: Path | None,
    announce: bool = True,
    verify: Callable[[Path, dict[str, Any]], Any] | None = None,
) -> CheckpointReader | None:
    """The checkpoint to resume from, verified.

    ``spec`` is "latest" (what ``root/latest`` names; if that one is missing or corrupt,
    the newest usable older one, with a warning), "auto" (the same, but None when
    ``root`` holds no checkpoint at all), or a path: a checkpoint folder (no fallback)
    or a checkpoint root (as "latest"). ``announce``: issue the fallback warning here.
    ``verify(folder, meta)``: how to check a candidate's files (default: every file's
    sha256 here; a resume passes the collective check, once per file per host).
    """

    def _open(folder: Path) -> CheckpointReader:
        if verify is None:
            return CheckpointReader(folder)
        reader = CheckpointReader(folder, verify=False)
        verify(folder, reader.meta)
        return reader

    if spec not in ("latest", "auto"):
        p = Path(spec)
        if p.is_dir() and not (p / METADATA).exists() and (read_latest(p) or list_steps(p)):
            return find_checkpoint("latest", p, announce, verify)
        if not p.exists():
            raise CheckpointError(f"no checkpoint at {p}")
        return _open(p)
    if root is None:
        raise CheckpointError(f"resume = {spec!r} needs train.checkpoint_dir")
    pointed = read_latest(root)
    candidates = [pointed] if pointed is not None else []
    candidates += [p for _, p in reversed(list_steps(root)) if p != pointed]
    if not candidates:
        if spec == "auto":
            return None
        raise CheckpointError(
            f"there is no checkpoint in {root} to resume from; start without --resume (or "
            "with train.resume = 'auto', which starts fresh when there is none)"
        )
    problems: list[str] = []
    for folder in candidates:
        try:
            reader = _open(folder)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if announce and (problems or pointed is None):
            why = "; ".join(problems) if problems else f"{root}/{LATEST} is missing"
            warnings.warn(
                f"resuming from {folder.name} instead of the latest checkpoint: {why}",
                RuntimeWarning,
                stacklevel=2,
            )
        return reader
    raise CheckpointError(f"no usable checkpoint in {root}: " + "; ".join(problems))
