"""``plait ps-train``: train the built-in transformer with a parameter server.

Starts ``--nproc`` local ranks (or joins torchrun's world): ranks 0..k-1 are servers
holding shards of the weights and AdamW, the others workers (see
:mod:`plait.ps.core`). Each worker takes its slice of every step's global
batch (``--batch`` sequences per worker) from ``--data``: the built-in corpus (its first
2 MB) by default, a text file or folder, a ``.npy``/``.bin`` token file (memory-mapped),
or a prepared folder (``plait data prepare``; memory-mapped, each worker reading only its
windows, validation from its held-out documents). ``--slow-worker I
--slow-work K`` makes worker I run K extra 128x128 matrix products before each step,
to watch the consistency models deal with a straggler. Rank 0 prints the run's
summary: steps per worker, withheld replies, the staleness of every applied gradient
(histogram) and the validation loss of the final weights; ``--records DIR`` writes
every applied gradient of every server as JSON lines.

torch and the parameter server are imported when the command runs, not with this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait.cli.common import check_output_path
from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.comm.group import AxisGroup
    from plait.config import ModelConfig
    from plait.ps.core import PSConfig, PSResult


def _parser() -> argparse.ArgumentParser:
    from plait.ps.core import MODES

    p = argparse.ArgumentParser(prog="plait ps-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=3, help="ranks (servers + workers; default 3)")
    p.add_argument("--servers", type=int, default=1, help="server ranks k (default 1)")
    p.add_argument("--mode", choices=MODES, default="sync", help="consistency model")
    p.add_argument("--staleness", type=int, default=0, help="s for --mode bounded")
    p.add_argument("--steps", type=int, default=20, help="steps per worker (default 20)")
    p.add_argument("--batch", type=int, default=4, help="sequences per worker and step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data",
        default="stdlib",
        metavar="SRC",
        help="the built-in corpus (default), a text file or folder, a .npy/.bin token file, "
        "or a prepared folder (memory-mapped)",
    )
    p.add_argument("--slow-worker", type=int, default=-1, help="index of a slow worker")
    p.add_argument("--slow-work", type=int, default=0, help="its extra matmuls per step")
    p.add_argument("--timeout", type=float, default=300.0, help="comm timeout (s)")
    p.add_argument(
        "--launch.backend",
        dest="backend",
        choices=("local", "ray"),
        default="local",
        help="'ray': servers and workers as Ray actors, weights passed by object reference",
    )
    p.add_argument(
        "--ray", dest="backend", action="store_const", const="ray", help="--launch.backend ray"
    )
    p.add_argument(
        "--launch.ray_address",
        dest="ray_address",
        default=None,
        help="Ray cluster: 'auto' or HOST:PORT (default: a private local one)",
    )
    p.add_argument(
        "--records",
        metavar="DIR",
        help="each server writes every applied gradient (worker, step, read version, "
        "version, staleness) to DIR/server<s>.jsonl",
    )
    return p


def ps_train_main(argv: Sequence[str]) -> int:
    """``plait ps-train``; returns the exit code."""
    from plait.launch.local import launch_local, torchrun_env
    from plait.ps.core import PSConfig

    args = _parser().parse_args(argv)
    env = torchrun_env()
    world = env.world_size if env is not None else args.nproc
    cfg = PSConfig(args.servers, args.mode, args.staleness, args.steps)
    cfg.validate(world)  # every bad input fails here, before any process starts
    _check_args(args, world - cfg.servers)
    if args.backend == "ray" and env is None:
        return _run_ray(args, cfg, world)
    if env is None:
        launch_local(world, ["ps-train", *argv])
        return 0
    _run_rank(args, cfg, env.rank, env.world_size)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a torchrun child: leave without gloo's exit-time abort


def _check_args(args: argparse.Namespace, workers: int) -> None:
    problems = []
    if args.batch < 1 or args.seq_len < 2:
        problems.append(f"--batch {args.batch} (>= 1) and --seq-len {args.seq_len} (>= 2)")
    try:  # the model's own validation (head count dividing dim, ...), in the parent
        _model_config(args)
    except ConfigError as e:
        problems.append(f"--dim {args.dim} / --layers {args.layers}: {e}")
    else:
        try:  # the data opens (and the model's vocabulary covers it) before any process
            _datasets(args)
        except ConfigError as e:
            problems.append(f"--data {args.data}: {e}")
    if args.slow_work < 0:
        problems.append(f"--slow-work {args.slow_work} (>= 0)")
    if not -1 <= args.slow_worker < workers:
        problems.append(f"--slow-worker {args.slow_worker} (a worker index 0..{workers - 1})")
    if not args.lr > 0:  # AdamW would refuse it in every child, after the launch
        problems.append(f"--lr {args.lr} (> 0)")
    if args.timeout <= 0:
        problems.append(f"--timeout {args.timeout} (> 0 seconds)")
    if args.records:  # a folder of server<i>.jsonl files: writable before anything runs
        try:
            check_output_path(str(Path(args.records) / "server0.jsonl"), "--records")
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("plait ps-train: bad arguments: " + "; ".join(problems))


def _model_config(args: argparse.Namespace) -> ModelConfig:
    from plait.config import ModelConfig

    return ModelConfig(dim=args.dim, n_layers=args.layers, max_seq_len=args.seq_len)


def _datasets(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(train, val)`` window sets of ``--data`` (:func:`plait.data.make_datasets`): a
    prepared folder memory-mapped, a source read whole otherwise (the built-in corpus's
    first 2 MB); 5 % held out."""
    from plait.config import DataConfig
    from plait.data import make_datasets

    data = DataConfig(source=args.data, max_bytes=2_000_000, val_fraction=0.05)
    return make_datasets(data, args.seq_len, _model_config(args).vocab_size)


def _samplers(args: argparse.Namespace, train_set: Any, workers: int) -> list[Any]:
    """Each worker's sampler: its slice of every step's ``--batch x workers`` windows."""
    from plait.data import BatchSampler

    g = args.batch * workers
    return [BatchSampler(len(train_set), g, w, workers, args.seed) for w in range(workers)]


def _run_rank(args: argparse.Namespace, cfg: PSConfig, rank: int, world: int) -> None:
    import torch

    from plait import comm
    from plait.mesh import init_mesh

    torch.set_num_threads(1)
    comm.init_world("gloo", rank, world, "env://", timeout_s=args.timeout)
    try:
        g = init_mesh(dp=world, timeout_s=args.timeout).axis("dp")
        summary = run_on_group(args, cfg, g)
        if rank == 0:
            print(summary)
    finally:
        comm.destroy_world()


def _run_ray(args: argparse.Namespace, cfg: PSConfig, world: int) -> int:
    """The servers and workers as Ray actors (:mod:`plait.ps.ray_server`); prints the
    same summary as the gloo version."""
    from plait.launch.ray_session import check_address, import_ray, ray_session

    import_ray()
    if args.ray_address:
        check_address(args.ray_address)
    with ray_session(args.ray_address, world):
        print(run_on_ray(args, cfg, world - cfg.servers), flush=True)
    return 0


def _setup(args: argparse.Namespace, workers: int) -> tuple[Any, Any, Any, Any]:
    """(model, loss_fn, AdamW factory, validation batch) of the built-in run."""
    import torch

    from plait.model import Transformer, lm_loss

    model = Transformer(_model_config(args), seed=args.seed)
    train_set, val_set = _datasets(args)
    samplers = _samplers(args, train_set, workers)
    heavy = torch.ones(128, 128)
    slow_worker, slow_work = args.slow_worker, args.slow_work

    def loss_fn(m: torch.nn.Module, worker: int, step: int) -> torch.Tensor:
        if worker == slow_worker:  # deterministic extra work, no sleeping
            for _ in range(slow_work):
                heavy.copy_(torch.mm(heavy, heavy).clamp_(-1, 1))
        x, y = train_set.batch(samplers[worker].rank_indices(step))  # (batch, seq)
        return lm_loss(m(x), y)

    lr = args.lr

    def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    return model, loss_fn, adamw, val_set.batch(list(range(min(len(val_set), 16))))


def run_on_ray(args: argparse.Namespace, cfg: PSConfig, workers: int) -> str:
    """Train with server and worker actors on the connected Ray instance; the summary."""
    import torch

    from plait.model import Transformer, lm_loss
    from plait.ps.ray_server import train_parameter_server_ray

    model, loss_fn, adamw, (vx, vy) = _setup(args, workers)
    mcfg, seed = _model_config(args), args.seed
    t0 = time.perf_counter()
    run = train_parameter_server_ray(
        model, lambda: Transformer(mcfg, seed=seed), loss_fn, adamw, cfg, workers, args.timeout
    )
    seconds = time.perf_counter() - t0
    if args.records:
        for res in run.servers:
            _write_records(Path(args.records) / f"server{res.index}.jsonl", res)
    with torch.no_grad():
        val_loss = float(lm_loss(model(vx), vy))
    puts = sorted({n for p in run.puts for n in p.values()})
    return _summary(run.servers[0], cfg, cfg.servers + workers, seconds, val_loss) + (
        f"\n  on Ray: weights ray.put per version: {puts} (workers fetch by reference)"
    )


def run_on_group(args: argparse.Namespace, cfg: PSConfig, g: AxisGroup) -> str:
    """Train on the ranks of ``g`` (every rank calls it); returns the run's summary
    (meaningful on axis index 0, server 0). Every rank ends with the final weights."""
    import torch

    from plait.model import Transformer, lm_loss
    from plait.ps.server import train_parameter_server

    model = Transformer(_model_config(args), seed=args.seed)
    train_set, val_set = _datasets(args)
    workers = g.size - cfg.servers
    samplers = _samplers(args, train_set, workers)
    heavy = torch.ones(128, 128)

    def loss_fn(m: torch.nn.Module, worker: int, step: int) -> torch.Tensor:
        if worker == args.slow_worker:  # deterministic extra work, no sleeping
            for _ in range(args.slow_work):
                heavy.copy_(torch.mm(heavy, heavy).clamp_(-1, 1))
        x, y = train_set.batch(samplers[worker].rank_indices(step))  # (batch, seq)
        return lm_loss(m(x), y)

    def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)

    t0 = time.perf_counter()
    res = train_parameter_server(model, g, loss_fn, adamw, cfg)
    seconds = time.perf_counter() - t0
    if args.records and res.role == "server":
        _write_records(Path(args.records) / f"server{res.index}.jsonl", res)
    with torch.no_grad():
        x, y = val_set.batch(list(range(min(len(val_set), 16))))  # (16, seq)
        val_loss = float(lm_loss(model(x), y))
    return _summary(res, cfg, g.size, seconds, val_loss)


def _write_records(path: Path, res: PSResult) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        json.dumps({"server": res.index, **dataclasses.asdict(a), "staleness": a.staleness})
        for a in res.records
    ]
    path.write_text("".join(r + "\n" for r in rows))


def _summary(res: PSResult, cfg: PSConfig, world: int, seconds: float, val: float) -> str:
    mode = f"{cfg.mode} (s={cfg.staleness})" if cfg.mode == "bounded" else cfg.mode
    hist = ", ".join(f"{k}: {v}" for k, v in res.staleness_histogram().items())
    return "\n".join(
        [
            f"plait ps-train: {cfg.servers} server(s), {world - cfg.servers} worker(s), "
            f"mode {mode}, {seconds:.1f} s",
            f"  server 0 applied {res.steps} update(s) from {len(res.records)} gradient(s)",
            f"  steps per worker: {res.worker_steps}",
            f"  replies withheld per worker: {res.blocked}",
            f"  staleness of applied gradients (staleness: count): {hist}",
            f"  max staleness: {res.max_staleness()}",
            f"  validation loss of the final weights: {val:.4f}",
        ]
    )
