"""Hyperparameter search on Ray Tune: each trial one full multi-rank ``plait train`` run.

A search space is a list of ``--search KEY=SPEC`` items over any config field:

- ``train.lr=1e-4,3e-4,1e-3`` — a grid over these values (``tune.grid_search``); several
  grid items multiply;
- ``train.lr=loguniform(1e-4,1e-2)``, ``uniform(a,b)``, ``randint(a,b)`` (b excluded) or
  ``choice(a,b,c)`` — sampled; ``--samples N`` draws N configurations (N times the grid
  when both are given).

Each trial is a Tune function trainable that runs ``python -m plait train <base flags>
<the trial's overrides> --nproc N`` in the trial's process — plait's local launcher, so
every trial is a real N-rank run with its own process group — and reserves N CPUs (one
per rank), so Tune runs as many trials at once as the cluster's CPUs allow. The trial
follows the run's metrics file and reports every step's loss to Tune, so a scheduler
(ASHA by default: grace period a quarter of the steps) can stop bad trials early; a
stopped trial's launcher is terminated (SIGTERM; it dies with the trial's process in any
case). Trials run on one node each (the local launcher); the cluster spreads trials.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.errors import ConfigError

_SAMPLERS = ("uniform", "loguniform", "randint", "choice")


@dataclass(frozen=True)
class SearchItem:
    """One ``--search`` item: a config key and either grid values or a sampler."""

    key: str
    values: tuple[str, ...]
    """Grid values (as command-line text), or the sampler's arguments."""
    sampler: str | None = None
    """None for a grid; else one of uniform, loguniform, randint, choice."""


def parse_search(spec: str) -> SearchItem:
    """``KEY=v1,v2`` or ``KEY=sampler(args)`` -> :class:`SearchItem` (ConfigError if bad)."""
    key, sep, rest = spec.partition("=")
    key, rest = key.strip().removeprefix("--"), rest.strip()
    if not sep or "." not in key or not rest:
        raise ConfigError(
            f"--search {spec!r}: expected SECTION.FIELD=v1,v2,... or "
            "SECTION.FIELD=uniform(a,b) | loguniform(a,b) | randint(a,b) | choice(a,b,...)."
        )
    for name in _SAMPLERS:
        if rest.startswith(name + "(") and rest.endswith(")"):
            args = tuple(a.strip() for a in rest[len(name) + 1 : -1].split(",") if a.strip())
            want = 2 if name != "choice" else len(args) or 1
            if len(args) != want or (name != "choice" and not _numbers(args)):
                raise ConfigError(f"--search {spec!r}: {name} takes {want} numbers, got {args}.")
            return SearchItem(key, args, name)
    values = tuple(v.strip() for v in rest.split(",") if v.strip())
    return SearchItem(key, values)


def _numbers(args: Sequence[str]) -> bool:
    try:
        [float(a) for a in args]
    except ValueError:
        return False
    return True


def check_space(items: Sequence[SearchItem], base: Sequence[str], world: int) -> None:
    """Validate the base run with every grid combination and every sampler's bounds or
    choices before any trial starts (the same checks ``plait train`` makes)."""
    from plait.config.toml_io import load_config
    from plait.parallel.checks import validate_run

    if not items:
        raise ConfigError("plait tune needs at least one --search KEY=VALUES item.")
    keys = [i.key for i in items]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"plait tune: a key is searched twice: {keys}.")
    options = [
        [v for v in i.values] if i.sampler in (None, "choice") else [i.values[0], i.values[1]]
        for i in items
    ]
    for combo in itertools.product(*options):
        overrides = [f"{k}={v}" for k, v in zip(keys, combo, strict=True)]
        if any(i.sampler == "randint" for i in items):  # randint's upper bound is excluded
            overrides = [
                f"{i.key}={int(v) - 1}" if i.sampler == "randint" and v == i.values[1] else o
                for i, v, o in zip(items, combo, overrides, strict=True)
            ]
        try:
            validate_run(load_config(None, [*base, *overrides]), world)
        except ConfigError as e:
            raise ConfigError(
                f"plait tune: the trial {' '.join(overrides)} is invalid: {e}"
            ) from None


def param_space(items: Sequence[SearchItem]) -> dict[str, Any]:
    """The Tune search space (values stay text: they become ``--key value`` flags)."""
    from ray import tune

    space: dict[str, Any] = {}
    for i in items:
        a = i.values
        if i.sampler is None:
            space[i.key] = tune.grid_search(list(a))
        elif i.sampler == "choice":
            space[i.key] = tune.choice(list(a))
        elif i.sampler == "uniform":
            space[i.key] = tune.uniform(float(a[0]), float(a[1]))
        elif i.sampler == "loguniform":
            space[i.key] = tune.loguniform(float(a[0]), float(a[1]))
        else:
            space[i.key] = tune.randint(int(a[0]), int(a[1]))
    return space


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """SIGTERM this process when the trial's process (its parent) dies (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


def _read_rows(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Complete JSON lines of ``path`` after byte ``offset``; (rows, new offset)."""
    if not path.exists():
        return [], offset
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    rows = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return rows, offset + end


def run_trial(config: dict[str, Any]) -> None:
    """Tune's function trainable: one ``plait train`` run with this trial's values."""
    from ray import tune

    trial_dir = Path(tune.get_context().get_trial_dir())
    trial_dir.mkdir(parents=True, exist_ok=True)
    metrics = trial_dir / "metrics.jsonl"
    flags = [f"--{k}={v}" for k, v in sorted(config["search"].items())]
    cmd = [
        sys.executable, "-m", "plait", "train", *config["base"], *flags,
        "--log.metrics", str(metrics), "--log.progress", "none",
    ]  # fmt: skip
    log = (trial_dir / "plait.log").open("w")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, cwd=config["cwd"], preexec_fn=_die_with_parent
    )
    offset, speeds = 0, []
    try:
        while True:
            try:
                proc.wait(timeout=0.25)
                finished = True
            except subprocess.TimeoutExpired:
                finished = False
            rows, offset = _read_rows(metrics, offset)
            for r in rows:
                if r.get("step", 0) > 1:
                    speeds.append(float(r["tokens_per_s"]))
                tps = sorted(speeds)[len(speeds) // 2] if speeds else float(r["tokens_per_s"])
                tune.report({"loss": float(r["loss"]), "step": int(r["step"]), "tokens_per_s": tps})
            if finished:
                break
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
        log.close()
    if proc.returncode != 0:
        tail = (trial_dir / "plait.log").read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"plait train exited with {proc.returncode}: {' | '.join(tail)}")


@dataclass
class TrialRow:
    """One line of the final table."""

    values: dict[str, str]
    loss: float
    tokens_per_s: float
    steps: int
    status: str


def run_search(
    items: Sequence[SearchItem],
    base: Sequence[str],
    nproc: int,
    steps: int,
    samples: int,
    scheduler: str,
    out: Path,
    max_concurrent: int | None = None,
) -> list[TrialRow]:
    """Run the search on the connected Ray instance; one row per trial, best first."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    sched: Any = (
        ASHAScheduler(max_t=steps, grace_period=max(1, steps // 4), reduction_factor=2)
        if scheduler == "asha"
        else FIFOScheduler()
    )
    trainable = tune.with_resources(run_trial, {"cpu": nproc})
    tuner = tune.Tuner(
        trainable,
        param_space={
            "search": param_space(items),
            "base": list(base),
            "cwd": os.getcwd(),
        },
        tune_config=tune.TuneConfig(
            metric="loss",
            mode="min",
            scheduler=sched,
            num_samples=samples,
            max_concurrent_trials=max_concurrent,
        ),
        run_config=tune.RunConfig(
            storage_path=str(out.resolve()), name="tune", verbose=0, log_to_file=True
        ),
    )
    grid = tuner.fit()
    rows = []
    for r in (grid[i] for i in range(len(grid))):
        m = r.metrics or {}
        status = "error" if r.error else ("done" if m.get("step") == steps else "stopped")
        loss = float(m.get("loss", math.nan))
        rows.append(
            TrialRow(
                dict((r.config or {}).get("search", {})),
                loss,
                float(m.get("tokens_per_s", math.nan)),
                int(m.get("step", 0)),
                status,
            )
        )
    rows.sort(key=lambda t: (math.isnan(t.loss), t.loss))
    return rows


def format_table(rows: Sequence[TrialRow]) -> str:
    """The trials as a text table: config values, final loss, tokens/s, steps, status."""
    keys = list(rows[0].values) if rows else []
    head = [*keys, "final loss", "tokens/s", "steps", "status"]
    body = [
        [*(str(r.values[k]) for k in keys), f"{r.loss:.4f}", f"{r.tokens_per_s:,.0f}",
         str(r.steps), r.status]
        for r in rows
    ]  # fmt: skip
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)
