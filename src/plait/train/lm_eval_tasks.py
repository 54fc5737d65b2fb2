"""Which lm-evaluation-harness tasks ``plait eval --tasks`` runs, and running them.

A task is named by the path of its YAML file, or by its name: looked up in the
``--include-path`` folders when given (only there: the harness's own 14,000 YAML files
take a minute to index), else among the harness's bundled tasks. :func:`resolve_tasks`
checks every name before any rank starts (an unknown one is a :class:`ConfigError`).

Each task is built with the working directory set to its YAML file's folder, so that
``dataset_path: json`` with ``dataset_kwargs: {data_files: ...}`` reads files relative to
the YAML: a task folder carries its data and nothing is downloaded. :func:`run_tasks` runs
the harness's ``simple_evaluate`` on a built ``LM`` (:class:`~plait.train.lm_eval_adapter.
PlaitLM`, or any other, e.g. the harness's ``HFLM`` as a reference).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.errors import ConfigError, install_hint


@dataclass(frozen=True)
class TaskSpec:
    """One task to run."""

    spec: str
    """What the harness's ``TaskManager.load`` takes: a YAML path or a task name."""
    folder: str | None
    """Where the task's YAML lies (relative data files are read there); None: the
    harness's bundled tasks."""
    include: tuple[str, ...] = ()
    """The ``--include-path`` folders the name was found in."""


def check_harness() -> None:
    """Refuse to go on without lm-evaluation-harness."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "plait eval --tasks needs lm-evaluation-harness (lm_eval); install it with "
            f"{install_hint('eval', 'lm_eval')}."
        ) from exc


def _manager(include: Sequence[str], defaults: bool) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include) or None, include_defaults=defaults)


def resolve_tasks(tasks: str, include_path: Sequence[str] = ()) -> list[TaskSpec]:
    """The comma-separated ``--tasks`` as specs, each checked (module docstring)."""
    check_harness()
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise ConfigError("--tasks is empty: give task names or task YAML files.")
    for folder in include_path:
        if not Path(folder).is_dir():
            raise ConfigError(f"--include-path {folder}: no such folder.")
    include = tuple(str(Path(p).resolve()) for p in include_path)
    out: list[TaskSpec] = []
    manager = None
    for name in names:
        path = Path(name)
        if path.suffix in (".yaml", ".yml") or path.is_file():
            if not path.is_file():
                raise ConfigError(f"--tasks {name}: no such task file.")
            out.append(TaskSpec(str(path.resolve()), str(path.resolve().parent)))
            continue
        if manager is None:
            manager = _manager(include, defaults=not include)
        entry = manager.task_index.get(name)
        if entry is None:
            where = f"in --include-path {', '.join(include_path)}" if include else "in lm_eval"
            known = ", ".join(sorted(manager.all_tasks)[:8]) if include else ""
            more = f" (tasks there: {known})" if known else ""
            raise ConfigError(
                f"unknown task {name!r}: not a task YAML file and not a task {where}{more}."
            )
        yaml_path = getattr(entry, "yaml_path", None)
        where_yaml = str(Path(yaml_path).parent) if yaml_path and include else None
        out.append(TaskSpec(name, where_yaml, include))
    return out


@contextlib.contextmanager
def _working_directory(folder: str | None) -> Iterator[None]:
    if folder is None:
        yield
        return
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def load_tasks(specs: Sequence[TaskSpec]) -> list[Any]:
    """The harness's task objects (groups expanded to their tasks), each built in its
    YAML's folder."""
    out: list[Any] = []
    for s in specs:
        manager = _manager(s.include, defaults=s.folder is None)
        with _working_directory(s.folder):
            loaded = manager.load([s.spec])
        out += list(loaded["tasks"].values())
    return out


def run_tasks(
    lm: Any,
    specs: Sequence[TaskSpec],
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    apply_chat_template: bool = False,
    bootstrap_iters: int = 100_000,
    seed: int = 0,
) -> dict[str, Any] | None:
    """``lm_eval.simple_evaluate`` of ``lm`` on the tasks: the results on the harness's
    rank 0 (None on its other ranks). Collective over the harness's ranks."""
    from lm_eval import simple_evaluate

    results = simple_evaluate(
        model=lm,
        tasks=load_tasks(specs),
        task_manager=_manager((), defaults=False),
        limit=limit,
        num_fewshot=num_fewshot,
        apply_chat_template=apply_chat_template,
        bootstrap_iters=bootstrap_iters,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
        log_samples=True,
    )
    return dict(results) if results is not None else None


def results_table(results: dict[str, Any]) -> str:
    """The harness's table of the results (and of the groups, when there are any)."""
    from lm_eval.utils import make_table

    table = str(make_table(results))
    if results.get("groups"):
        table += "\n" + str(make_table(results, "groups"))
    return table


def write_results(results: dict[str, Any], path: str) -> None:
    """The results as the harness writes them (per-sample records left out)."""
    from lm_eval.utils import handle_non_serializable

    body = {k: v for k, v in results.items() if k != "samples"}
    text = json.dumps(body, indent=2, default=handle_non_serializable, ensure_ascii=False)
    Path(path).write_text(text + "\n", encoding="utf-8")
