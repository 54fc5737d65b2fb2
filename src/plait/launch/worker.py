"""What every rank runs: join the world, build the mesh, train (or evaluate), leave.

A rank of a launcher reports its memory for it (:mod:`plait.launch.oom`) and turns an
allocation failure into :class:`~plait.errors.OutOfMemoryError` naming the rank and its
peak memory.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from plait import comm
from plait.config import Config
from plait.launch.local import RankEnv
from plait.launch.oom import as_out_of_memory, is_out_of_memory, start_reporter
from plait.launch.parent import die_with_parent
from plait.mesh import Mesh, init_mesh

T = TypeVar("T")


def resolve_device(cfg: Config, local_rank: int) -> torch.device:
    """The device of this rank: ``cuda:<local rank>`` or the CPU."""
    want = cfg.launch.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("launch.device is 'cuda' but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def resolve_backend(cfg: Config, device: torch.device) -> str:
    """gloo on CPU, NCCL on CUDA, unless set explicitly."""
    if cfg.parallel.backend != "auto":
        return cfg.parallel.backend
    return "nccl" if device.type == "cuda" else "gloo"


def run_rank(
    cfg: Config, env: RankEnv | None, show_progress: bool = True, init_method: str = "env://"
) -> dict[str, Any]:
    """Train on this rank (``env`` None: one process, no process group). ``init_method``:
    where the world meets (torchrun's ``env://``; Ray ranks meet at rank 0's address)."""
    from plait.train.trainer import Trainer

    def train(mesh: Mesh) -> dict[str, Any]:
        return dataclasses.asdict(Trainer(cfg, mesh, show_progress=show_progress).run())

    return on_rank(cfg, env, train, init_method)


def on_rank(
    cfg: Config, env: RankEnv | None, work: Callable[[Mesh], T], init_method: str = "env://"
) -> T:
    """``work(mesh)`` on this rank: die with the launcher, report memory to it, set the
    device and threads, join the world (``env`` None: one process, no process group),
    build the mesh, run, leave; an allocation failure is named
    (:class:`~plait.errors.OutOfMemoryError`: which rank, which memory, its peak)."""
    if env is not None:  # a rank of plait's launcher or of torchrun: die with it
        die_with_parent()
    reporter = start_reporter(env.rank) if env is not None else None  # for the launcher
    local_rank = env.local_rank if env else 0
    local_world = env.local_world_size if env else 1
    device = resolve_device(cfg, local_rank)
    threads = cfg.launch.threads or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    joined = False
    if env is not None and env.world_size > 1:
        comm.init_world(
            resolve_backend(cfg, device),
            env.rank,
            env.world_size,
            init_method,
            timeout_s=cfg.parallel.timeout_s,
        )
        joined = True
    try:
        p = cfg.parallel
        mesh = init_mesh(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, timeout_s=p.timeout_s, device=device)
        return work(mesh)
    except Exception as e:
        if is_out_of_memory(e):
            raise as_out_of_memory(e, env.rank if env else 0, device) from e
        raise
    finally:
        if reporter is not None:
            reporter.stop()
        if joined:
            comm.destroy_world()
