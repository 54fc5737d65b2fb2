"""``plait eval --tasks``: lm-evaluation-harness tasks on plait's model, on any layout.

``plait eval --init-from DIR_OR_CKPT --tasks TASK_OR_YAML[,...] [--include-path DIR]
[--apply-chat-template] [--num-fewshot N] [--limit N] [--batch-size B] [--output-json
FILE]`` loads the model the way ``plait eval`` and ``plait generate`` do (a checkpoint,
a run's checkpoint folder, a consolidated weights file or a Hugging Face folder; the
model's shape and tokenizer from the checkpoint or the folder), runs the harness's
``simple_evaluate`` with the model behind its ``LM`` interface
(:mod:`plait.train.lm_eval_adapter`), prints the harness's table on stdout (rank 0) and
writes its results JSON to ``--output-json``.

Tasks (:mod:`plait.train.lm_eval_tasks`): a task YAML file, or a task name found in the
``--include-path`` folders (or, without it, among the harness's bundled tasks, whose
data the harness downloads). An unknown task, a missing file or a missing ``lm_eval``
package exits 2 with one line before any rank starts. The layout flags are the training
run's (``--nproc --dp --tp --pp --cp --zero``): the harness's ranks are the dp ranks;
generation tasks need pp = 1 (``plait generate``'s rule).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.config import Config
    from plait.mesh import Mesh
    from plait.train.lm_eval_tasks import TaskSpec


@dataclass(frozen=True)
class TaskArgs:
    """What ``--tasks`` runs, besides the run's config."""

    specs: list[TaskSpec]
    limit: int | None
    num_fewshot: int | None
    apply_chat_template: bool
    batch_size: int
    bootstrap_iters: int
    output_json: str | None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plait eval --tasks",
        description=(
            "Run lm-evaluation-harness tasks on the model in --init-from. Layout flags and "
            "--config as for plait train (--nproc --dp --tp --pp --cp --zero ...)."
        ),
    )
    p.add_argument("--config", metavar="PATH", help="TOML file with the run's configuration")
    p.add_argument("--tasks", required=True, metavar="TASK_OR_YAML[,...]", help="tasks to run")
    p.add_argument(
        "--include-path",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of task YAML files to look names up in (repeatable)",
    )
    p.add_argument(
        "--apply-chat-template", action="store_true", help="render prompts with the chat template"
    )
    p.add_argument("--num-fewshot", type=int, metavar="N", help="few-shot examples per prompt")
    p.add_argument("--limit", type=int, metavar="N", help="only the first N documents per task")
    p.add_argument(
        "--batch-size", type=int, default=8, metavar="B", help="sequences per forward (8)"
    )
    p.add_argument(
        "--bootstrap-iters",
        type=int,
        default=100_000,
        metavar="N",
        help="bootstrap resamples for the standard errors (0: none; default 100000)",
    )
    p.add_argument("--output-json", metavar="FILE", help="write the harness's results JSON here")
    return p


def _config(rest: Sequence[str]) -> tuple[Config, TaskArgs]:
    """The run's config and the tasks, every check done (one line each)."""
    from plait.cli.common import check_output_path, parse_run_flags
    from plait.cli.model_source import checkpoint_defaults
    from plait.cli.train import pretrained_defaults
    from plait.config import ModelConfig
    from plait.config.coerce import config_from_dict
    from plait.config.toml_io import load_config_data
    from plait.train.lm_eval_tasks import resolve_tasks

    overrides, ns = parse_run_flags(_parser(), rest)
    for flag, value in (("--limit", ns.limit), ("--batch-size", ns.batch_size)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be positive, got {value}.")
    if ns.num_fewshot is not None and ns.num_fewshot < 0:
        raise ConfigError(f"--num-fewshot must be 0 or more, got {ns.num_fewshot}.")
    if ns.bootstrap_iters < 0:
        raise ConfigError(f"--bootstrap-iters must be 0 or more, got {ns.bootstrap_iters}.")
    check_output_path(ns.output_json, "--output-json")
    data = load_config_data(ns.config, overrides)
    if not data.get("train", {}).get("init_from"):
        raise ConfigError(
            "plait eval --tasks needs --init-from PATH: a checkpoint folder, a run's "
            "checkpoint folder, a consolidated weights file or a Hugging Face model folder."
        )
    checkpoint_defaults(data, adapters=True)  # a LoRA run's: its base and its adapters
    pretrained_defaults(data)  # a Hugging Face folder: the sizes and tokenizer from it
    limit = data.get("model", {}).get("max_seq_len", ModelConfig.max_seq_len)
    data["train"].setdefault("seq_len", limit)  # training's default may exceed the model's
    cfg = config_from_dict(data)
    specs = resolve_tasks(ns.tasks, ns.include_path)
    if ns.apply_chat_template:
        from plait.train.lm_eval_adapter import eval_tokenizer

        if not getattr(eval_tokenizer(cfg.data.tokenizer), "chat_template", None):
            raise ConfigError(
                f"--apply-chat-template: the tokenizer {cfg.data.tokenizer} has no chat "
                "template (chat_template.jinja, or chat_template in tokenizer_config.json)."
            )
    args = TaskArgs(
        specs,
        ns.limit,
        ns.num_fewshot,
        ns.apply_chat_template,
        ns.batch_size,
        ns.bootstrap_iters,
        ns.output_json,
    )
    return cfg, args


def run_on(mesh: Mesh, cfg: Config, args: TaskArgs) -> dict[str, Any] | None:
    """Load ``cfg``'s model on ``mesh`` and run the tasks (collective over the mesh);
    the results on the harness's rank 0, None elsewhere."""
    from plait.cli.eval import load_model
    from plait.train.lm_eval_adapter import PlaitLM, eval_tokenizer
    from plait.train.lm_eval_tasks import run_tasks

    model = load_model(cfg, mesh)
    m = cfg.model
    tokenizer = eval_tokenizer(cfg.data.tokenizer)
    lm = PlaitLM(model, tokenizer, m.vocab_size, m.max_seq_len, batch_size=args.batch_size)
    return run_tasks(
        lm,
        args.specs,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        apply_chat_template=args.apply_chat_template,
        bootstrap_iters=args.bootstrap_iters,
        seed=cfg.train.seed,
    )


def _eval_tasks(rest: Sequence[str]) -> int:
    """Validate, then run here (one process, or a rank) or start the ranks."""
    from plait.cli.common import leave_torchrun_child, start_checks
    from plait.launch.local import launch_local
    from plait.launch.worker import on_rank
    from plait.train.lm_eval_tasks import results_table, write_results

    cfg, args = _config(rest)
    env, world = start_checks(cfg)
    if env is None and world > 1:
        return launch_local(world, ["eval", *rest])
    results = on_rank(cfg, env, lambda mesh: run_on(mesh, cfg, args))
    if (env is None or env.rank == 0) and results is not None:
        print(results_table(results), flush=True)
        if args.output_json:
            write_results(results, args.output_json)
            sys.stderr.write(f"plait: results written to {args.output_json}\n")
    leave_torchrun_child(env)
    return 0


def eval_tasks_main(rest: Sequence[str]) -> int:
    """``plait eval --tasks``."""
    from plait.cli.common import run_as_rank

    return run_as_rank(_eval_tasks, rest)
