"""The loggers write what each backend's own reader reads back, without any network.

* TensorBoard: event files read with tensorboard's ``EventAccumulator``.
* Weights & Biases, ``mode='offline'``: the run's ``.wandb`` transaction log under the
  run folder, read record by record (LevelDB log framing, wandb's protobuf records).
* MLflow, ``log.mlflow = 'local'``: a SQLite store under the run folder, read with
  ``MlflowClient.get_metric_history``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from plait.config import Config, LogConfig
from plait.errors import ConfigError
from plait.train.loggers import (
    MlflowLogger,
    TensorBoardLogger,
    WandbLogger,
    make_loggers,
    mlflow_uri,
    scalars_of,
)

STEPS = {1: {"loss": 5.5, "tokens_per_s": 100.0}, 2: {"loss": 4.25, "val_loss": 4.5}}


def _feed(logger: TensorBoardLogger | WandbLogger | MlflowLogger) -> None:
    for step, scalars in STEPS.items():
        logger.log(step, scalars)
    logger.close()


def test_scalars_of_keeps_finite_numbers_only() -> None:
    row = {"step": 3, "loss": 2.0, "val_loss": None, "mfu": float("nan"), "skipped": True}
    assert scalars_of(row) == {"loss": 2.0}


def test_tensorboard_event_files_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _feed(TensorBoardLogger(str(tmp_path / "tb"), {"train.steps": 2}))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {"train/loss", "train/tokens_per_s", "train/val_loss"} <= set(acc.Tags()["scalars"])
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss == [(1, 5.5), (2, 4.25)]
    assert [(e.step, e.value) for e in acc.Scalars("train/val_loss")] == [(2, 4.5)]


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a .wandb file: a 7-byte header, then LevelDB-log chunks (crc32,
    length, type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks."""
    data, block, pos = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    records, part = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(part)
            part = b""
    return records


def test_wandb_offline_run_reads_back(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2 as pb

    logger = WandbLogger(str(tmp_path), "offline", "plait-test", {"train.steps": 2})
    assert "offline" in logger.name
    _feed(logger)
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history = []
    for raw in _wandb_records(run_file):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            history.append(
                {k: v for k, v in items.items() if not k.startswith("_")} | {"step": items["_step"]}
            )
    assert history == [
        {"step": 1, "loss": 5.5, "tokens_per_s": 100.0},
        {"step": 2, "loss": 4.25, "val_loss": 4.5},
    ]


def test_mlflow_local_store_reads_back(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    cfg = Config(log=LogConfig(dir=str(tmp_path / "run"), mlflow="local"))
    uri = mlflow_uri(cfg)
    assert uri is not None and uri.startswith("sqlite:///") and str(tmp_path) in uri
    (logger,) = make_loggers(cfg)
    assert isinstance(logger, MlflowLogger)
    _feed(logger)
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == str(cfg.train.steps)
    loss = [(m.step, m.value) for m in client.get_metric_history(logger.run_id, "loss")]
    assert sorted(loss) == [(1, 5.5), (2, 4.25)]


def test_missing_package_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real = builtins.__import__

    def no_wandb(name: str, *args: object, **kwargs: object) -> object:
        if name == "wandb":
            raise ImportError("no wandb here")
        return real(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ConfigError, match=r"log.wandb = 'offline' needs the wandb package.*pip"):
        WandbLogger("unused", "offline", "p")


def test_no_loggers_by_default() -> None:
    assert make_loggers(Config()) == []
