"""Command line: ``plait train`` (and ``python -m plait train``).

Configuration comes from a TOML file (``--config run.toml``), then dotted overrides
(``--train.steps 50``, ``--parallel.dp=2``) and short aliases (``--nproc --dp --tp --pp
--cp --zero --steps`` ...). Everything is validated before any process starts; a bad
input prints one paragraph and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from plait import __version__
from plait.errors import ConfigError, PlaitError

EXIT_BAD_INPUT = 2

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("plait.cli:train_main", "train the built-in transformer"),
    "plan": ("plait.cli.plan:plan_main", "predict memory and step time; search layouts"),
    "calibrate": ("plait.cli.plan:calibrate_main", "alias of `plait bench calibrate`"),
    "bench": ("plait.bench:main", "benchmarks: `plait bench comm | calibrate`"),
    "ps-train": ("plait.cli.ps:ps_train_main", "parameter-server training (sync/async/bounded)"),
    "checkpoint": ("plait.cli.checkpoint:checkpoint_main", "checkpoint info | consolidate"),
    "pipeline": ("plait.cli.pipeline:pipeline_main", "pipeline schedules: draw | show"),
}
"""Subcommand name -> ("module:function", one-line help). Each function takes the
arguments after the subcommand name and returns an exit code; it may raise
ConfigError (reported in one paragraph, exit code 2) or PlaitError (exit code 1)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plait",
        description="Distributed training for PyTorch on one device mesh.",
    )
    p.add_argument("--version", action="version", version=f"plait {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in SUBCOMMANDS.items():
        if name != "train":
            sub.add_parser(name, help=help_text, add_help=False)
    t = sub.add_parser(
        "train",
        help="train the built-in transformer",
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
    return p


def _train(rest: Sequence[str], argv: Sequence[str]) -> int:
    from plait.config_io import format_field_docs, load_config, parse_override_flags
    from plait.launch.local import launch_local, torchrun_env

    overrides, remaining = parse_override_flags(rest)
    ns = _parser().parse_args(["train", *remaining])
    if ns.help_config:
        print(format_field_docs())
        return 0
    if ns.resume:
        overrides.append(f"train.resume={ns.resume}")
    cfg = load_config(ns.config, overrides)
    env = torchrun_env()
    world = env.world_size if env is not None else cfg.launch.nproc
    from plait.parallel.checks import validate_run

    validate_run(cfg, world)
    from plait.train.checkpoint import check_start

    check_start(cfg, world)  # resume / init-from sources exist, fault-injection rank
    if cfg.launch.check_memory:  # the planner's memory verdict, before any process starts
        from plait.plan.fit import refuse_unless_fits

        per_host = env.local_world_size if env is not None else world
        refuse_unless_fits(cfg, world, per_host, _cuda_device())
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


def _cuda_device() -> tuple[str, float] | None:
    """(name, total memory in bytes) of the first CUDA GPU, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, float(props.total_memory)


def _check_data(cfg: object) -> None:
    from plait.config import Config
    from plait.train.data import TokenDataset, check_enough, load_tokens, split_train_val

    assert isinstance(cfg, Config)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plait`` console script; returns the exit code."""
    import importlib

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in SUBCOMMANDS:
        _parser().parse_args(args)  # prints usage / version / an error (exit 2)
        return EXIT_BAD_INPUT
    module, _, func = SUBCOMMANDS[args[0]][0].partition(":")
    run = getattr(importlib.import_module(module), func)
    try:
        code = run(args[1:])
        return int(code) if code is not None else 0
    except ConfigError as e:  # includes DataError
        print(f"plait: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except PlaitError as e:
        print(f"plait: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("plait: interrupted", file=sys.stderr)
        return 130
