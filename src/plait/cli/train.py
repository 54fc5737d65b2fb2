"""``plait train``: the training run, on one machine or under torchrun.

Configuration comes from a TOML file (``--config run.toml``), then dotted overrides
(``--train.steps 50``, ``--parallel.dp=2``) and short aliases (``--nproc --dp --tp --pp
--cp --zero --steps`` ...). Everything is validated before any process starts (the
config, the parallel layer's checks, the checkpoint sources, the planner's memory
verdict, the dataset); a bad input prints one paragraph and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plait.config import Config


def _parser() -> argparse.ArgumentParser:
    t = argparse.ArgumentParser(
        prog="plait train",
        description=(
            "Train the built-in transformer. Any config field can be set with a dotted "
            "flag (--train.steps 50); short aliases: --nproc --dp --tp --pp --cp --zero "
            "--steps --global-batch --micro-batch --seq-len --lr --seed --data --metrics "
            "--device --progress. See --help-config for every field."
        ),
    )
    t.add_argument("--config", metavar="PATH", help="TOML file with the run's configuration")
    t.add_argument("--help-config", action="store_true", help="print every config field and exit")
    t.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="PATH",
        help="continue from train.checkpoint_dir's latest checkpoint, or from PATH (sets "
        "train.resume; 'auto': latest if any, else start fresh)",
    )
    t.add_argument(
        "--ray",
        action="store_true",
        help="run the ranks as Ray actors (same as --launch.backend ray; see docs/ray.md)",
    )
    return t


def _train(rest: Sequence[str], argv: Sequence[str]) -> int:
    """Validate everything, then start ``nproc`` local ranks that each run ``python -m
    plait <argv>``, or (one process, or a rank under torchrun) train in this process."""
    from plait.config_io import format_field_docs, load_config, parse_override_flags
    from plait.launch.local import launch_local, torchrun_env

    overrides, remaining = parse_override_flags(rest)
    ns = _parser().parse_args(list(remaining))
    if ns.help_config:
        print(format_field_docs())
        return 0
    if ns.resume:
        overrides.append(f"train.resume={ns.resume}")
    if ns.ray:
        overrides.append("launch.backend=ray")
    cfg = load_config(ns.config, overrides)
    env = torchrun_env()
    world = env.world_size if env is not None else cfg.launch.nproc
    if cfg.launch.backend == "ray" and env is None:  # one line and exit 2, before any work
        from plait.launch.ray_session import check_address, import_ray

        import_ray()
        if cfg.launch.ray_address:
            check_address(cfg.launch.ray_address)
    from plait.parallel.checks import validate_run

    validate_run(cfg, world)
    from plait.train.checkpoint import check_start

    check_start(cfg)  # the resume / init-from sources exist
    if cfg.launch.check_memory:  # the planner's memory verdict, before any process starts
        from plait.plan.fit import refuse_unless_fits

        per_host = env.local_world_size if env is not None else world
        refuse_unless_fits(cfg, world, per_host, _cuda_device())
    if cfg.launch.backend != "local" and env is None:
        _check_data(cfg)
        return _launch_backend(cfg, world)
    if env is None and world > 1:
        _check_data(cfg)  # fail here, once, before starting any process
        launch_local(world, list(argv))
        return 0
    from plait.launch.worker import run_rank

    run_rank(cfg, env)
    if env is not None:  # a torchrun child: leave without gloo's exit-time abort
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _launch_backend(cfg: Config, world: int) -> int:
    """``launch.backend`` ray (the ranks as Ray actors) or torchrun (refused outside it)."""
    from plait.errors import ConfigError

    if cfg.launch.backend == "torchrun":
        raise ConfigError(
            "launch.backend is 'torchrun' but this process was not started by torchrun; run "
            "`torchrun --nproc-per-node N -m plait train ...`, or use --launch.backend local."
        )
    from plait.launch.ray_backend import launch_ray

    launch_ray(cfg, world)
    return 0


def _cuda_device() -> tuple[str, float] | None:
    """(name, total memory in bytes) of the first CUDA GPU, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, float(props.total_memory)


def _check_data(cfg: Config) -> None:
    """Refuse a corpus too small for one global batch of training or validation data."""
    from plait.train.data import TokenDataset, check_enough, load_tokens, split_train_val

    train, val = split_train_val(load_tokens(cfg.data), cfg.data.val_fraction)
    check_enough(TokenDataset(train, cfg.train.seq_len), cfg.train.global_batch, "training")
    check_enough(TokenDataset(val, cfg.train.seq_len), cfg.train.global_batch, "validation")


def train_main(rest: Sequence[str]) -> int:
    """``plait train``."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from plait.launch.local import torchrun_env

    # under the elastic agent, record() writes a failing rank's error for the parent
    train = record(_train) if torchrun_env() is not None else _train
    return int(train(rest, ["train", *rest]) or 0)
