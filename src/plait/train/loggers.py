"""Experiment loggers behind one small interface: TensorBoard, Weights & Biases, MLflow.

A :class:`Logger` takes a step's scalars (``log(step, {"loss": ..., ...})``) and is
closed at the end of the run; rank 0 feeds every logger the same numbers it writes to
the metrics JSONL (:class:`~plait.train.metrics.MetricsWriter`). Which loggers run is
configuration (``[log]``):

==============  ====================================================================
``tensorboard``  event files in the folder named (``torch.utils.tensorboard``)
``wandb``        ``offline``: a run under ``<log.dir>/wandb`` with no network
                 (``wandb sync`` uploads it later); ``online``: the W&B service
``mlflow``       a tracking URI, or ``local``: a SQLite store ``<log.dir>/mlflow.db``
==============  ====================================================================

W&B and MLflow are optional packages; asking for one that is not installed is a
:class:`~plait.errors.ConfigError` with the install command.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from plait.config import Config
from plait.errors import ConfigError, install_hint

SCALARS = (
    "loss",
    "val_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "mfu",
    "step_seconds",
    "comm_bytes",
    "comm_seconds",
    "loss_scale",
)
"""The per-step metrics every logger receives (those that are set that step)."""


class Logger(Protocol):
    """Where a run's scalars go besides the metrics JSONL."""

    name: str
    """What the end-of-run summary calls it (e.g. ``tensorboard runs/tb``)."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record the scalars of optimizer step ``step`` (1-based)."""

    def close(self) -> None:
        """Flush and release files or connections."""


def scalars_of(row: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric :data:`SCALARS` of one metrics row (a StepMetrics as dict)."""
    out: dict[str, float] = {}
    for key in SCALARS:
        value = row.get(key)
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if numeric and math.isfinite(value):  # type: ignore[arg-type]
            out[key] = float(value)  # type: ignore[arg-type]
    return out


class TensorBoardLogger:
    """Scalars as TensorBoard event files (``train/loss``, ``train/val_loss``, ...)."""

    def __init__(self, folder: str, config: Mapping[str, Any] | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.name = f"tensorboard {folder}"
        self._writer = SummaryWriter(log_dir=folder)
        if config:
            text = "\n".join(f"    {k} = {v!r}" for k, v in sorted(config.items()))
            self._writer.add_text("config", text, 0)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(f"train/{key}", value, step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class WandbLogger:
    """A Weights & Biases run; ``mode='offline'`` writes it under ``folder`` only."""

    def __init__(
        self, folder: str, mode: str, project: str, config: Mapping[str, Any] | None = None
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(
                f"log.wandb = {mode!r} needs the wandb package, which is not installed; "
                f"install it with {install_hint('wandb', 'wandb')}, or set log.wandb off."
            ) from exc
        Path(folder).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project,
            dir=folder,
            mode=mode,  # type: ignore[arg-type]
            config=dict(config or {}),
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )
        where = self._run.dir if mode == "offline" else self._run.url
        self.name = f"wandb ({mode}) {where}"

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        import wandb

        self._run.finish()
        # finish() only *informs* wandb's service process that the run is over; the
        # service closes (flushes) the run file later.  teardown() waits for the
        # service to exit, so the run's files are complete when close() returns.
        wandb.teardown()


class MlflowLogger:
    """An MLflow run in the experiment ``experiment`` at ``tracking_uri``."""

    def __init__(
        self, tracking_uri: str, experiment: str, config: Mapping[str, Any] | None = None
    ) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ConfigError(
                "log.mlflow needs the mlflow package, which is not installed; install it "
                f"with {install_hint('mlflow', 'mlflow')}, or leave log.mlflow unset."
            ) from exc
        self._client = MlflowClient(tracking_uri=tracking_uri)
        found = self._client.get_experiment_by_name(experiment)
        exp_id = (
            found.experiment_id if found is not None else self._client.create_experiment(experiment)
        )
        self._run_id = self._client.create_run(exp_id).info.run_id
        for key, value in sorted((config or {}).items()):
            self._client.log_param(self._run_id, key, str(value)[:500])
        self.name = f"mlflow {tracking_uri} (run {self._run_id})"

    @property
    def run_id(self) -> str:
        return self._run_id

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(1000 * time.time())
        metrics = [Metric(k, v, ms, step) for k, v in scalars.items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def flat_config(cfg: Config) -> dict[str, Any]:
    """``{"section.field": value}`` for every field (what loggers record as parameters)."""
    import dataclasses

    out: dict[str, Any] = {}
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            out[f"{section.name}.{f.name}"] = getattr(getattr(cfg, section.name), f.name)
    return out


def mlflow_uri(cfg: Config) -> str | None:
    """The tracking URI ``log.mlflow`` names (``local``: a SQLite store under log.dir)."""
    uri = cfg.log.mlflow
    if uri == "local":  # MLflow 3 keeps its file store in maintenance mode: use SQLite
        return "sqlite:///" + str((Path(cfg.log.dir) / "mlflow.db").resolve())
    return uri


def make_loggers(cfg: Config) -> list[Logger]:
    """The loggers ``cfg.log`` asks for (call on rank 0 only)."""
    params = flat_config(cfg)
    loggers: list[Logger] = []
    log = cfg.log
    if log.tensorboard:
        loggers.append(TensorBoardLogger(log.tensorboard, params))
    if log.wandb != "off":
        loggers.append(WandbLogger(log.dir, log.wandb, log.project, params))
    uri = mlflow_uri(cfg)
    if uri:
        loggers.append(MlflowLogger(uri, log.project, params))
    return loggers
