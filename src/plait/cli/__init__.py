"""The ``plait`` command line: one module per sub-command.

==========  ===============================================  =========================
command     what it does                                     module
==========  ===============================================  =========================
train       train the built-in transformer                   :mod:`plait.cli.train`
eval        loss on a file; ``--tasks``: lm-eval-harness    :mod:`plait.cli.eval`
generate    continue a prompt (KV cache; greedy or sampled)  :mod:`plait.cli.generate`
plan        predict memory and step time; search layouts      :mod:`plait.cli.plan`
calibrate   alias of ``plait bench calibrate``                :mod:`plait.cli.bench`
bench       benchmarks: ``plait bench comm | calibrate``      :mod:`plait.cli.bench`
ps-train    parameter-server training (sync/async/bounded)   :mod:`plait.cli.ps`
checkpoint  checkpoint info | consolidate | export           :mod:`plait.cli.checkpoint`
pipeline    pipeline schedules: draw | show                  :mod:`plait.cli.pipeline`
plot        draw runs' metrics (loss, val, tokens/s, comm)   :mod:`plait.cli.plot`
tune        hyperparameter search on Ray Tune                :mod:`plait.cli.tune`
data        ``plait data prepare | info``: token shards      :mod:`plait.cli.data`
models      the Hugging Face families plait loads / refuses  :mod:`plait.cli.models`
==========  ===============================================  =========================

Each sub-command is a function taking the arguments after its name and returning an
exit code; it may raise :class:`~plait.errors.ConfigError` (reported in one paragraph,
exit code 2) or :class:`~plait.errors.PlaitError` (exit code 1); Ctrl-C exits with 130
(:mod:`plait.cli.common`). A sub-command's module is imported only when its command
runs, so ``plait --help`` starts without torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from plait import __version__
from plait.cli.common import EXIT_BAD_INPUT, Command, run_command

__all__ = ["EXIT_BAD_INPUT", "SUBCOMMANDS", "main"]


def _train() -> Command:
    from plait.cli.train import train_main

    return train_main


def _eval() -> Command:
    from plait.cli.eval import eval_main

    return eval_main


def _generate() -> Command:
    from plait.cli.generate import generate_main

    return generate_main


def _plan() -> Command:
    from plait.cli.plan import plan_main

    return plan_main


def _calibrate() -> Command:
    from plait.cli.bench import calibrate_main

    return calibrate_main


def _bench() -> Command:
    from plait.cli.bench import bench_main

    return bench_main


def _ps_train() -> Command:
    from plait.cli.ps import ps_train_main

    return ps_train_main


def _checkpoint() -> Command:
    from plait.cli.checkpoint import checkpoint_main

    return checkpoint_main


def _pipeline() -> Command:
    from plait.cli.pipeline import pipeline_main

    return pipeline_main


def _plot() -> Command:
    from plait.cli.plot import plot_main

    return plot_main


def _tune() -> Command:
    from plait.cli.tune import tune_main

    return tune_main


def _data() -> Command:
    from plait.cli.data import data_main

    return data_main


def _models() -> Command:
    from plait.cli.models import models_main

    return models_main


SUBCOMMANDS: dict[str, tuple[Callable[[], Command], str]] = {
    "train": (_train, "train the built-in transformer"),
    "eval": (
        _eval,
        "mean next-token loss and perplexity of a model on a token file; --tasks: "
        "lm-evaluation-harness tasks",
    ),
    "generate": (_generate, "continue a prompt with a checkpoint's model (KV cache)"),
    "plan": (_plan, "predict memory and step time; search layouts"),
    "calibrate": (_calibrate, "alias of `plait bench calibrate`"),
    "bench": (_bench, "benchmarks: `plait bench comm | calibrate`"),
    "ps-train": (_ps_train, "parameter-server training (sync/async/bounded)"),
    "checkpoint": (_checkpoint, "checkpoint info | consolidate | export"),
    "pipeline": (_pipeline, "pipeline schedules: draw | show"),
    "plot": (_plot, "draw runs' metrics (loss, validation loss, tokens/s, comm) into a PNG"),
    "tune": (_tune, "hyperparameter search on Ray Tune (each trial a multi-rank run)"),
    "data": (_data, "prepare data: `plait data prepare SRC -o DIR --tokenizer SPEC` | info"),
    "models": (_models, "the Hugging Face families plait loads and exports, and those it refuses"),
}
"""Sub-command name -> (the function that imports and returns it, one-line help)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plait",
        description="Distributed training for PyTorch on one device mesh.",
    )
    p.add_argument("--version", action="version", version=f"plait {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plait`` console script; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in SUBCOMMANDS:
        _parser().parse_args(args)  # prints usage / version / an error (exit 2)
        return EXIT_BAD_INPUT
    load, _ = SUBCOMMANDS[args[0]]
    return run_command(load(), args[1:])
