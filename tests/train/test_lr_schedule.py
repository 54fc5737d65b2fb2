"""Learning-rate schedules equal their formulas, written out by hand here, at chosen steps
(warm-up, stable, decay, last step) and across a resume; a small validation set is
evaluated (padded with ignored targets) instead of refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from plait.checkpoint.format import step_dirname
from plait.cli import main
from plait.config import Config, TrainConfig
from plait.data import TokenDataset
from plait.errors import ConfigError
from plait.train.lr_schedule import lr_at
from plait.train.validation import Validation
from tests.tiny import tiny_args


def _cfg(schedule: str, shape: str = "1-sqrt") -> Config:
    """10 steps, 2 warm-up steps, peak 1.0, floor 0.1; WSD decays over ceil(0.3·10) = 3."""
    t = TrainConfig(
        steps=10,
        warmup_steps=2,
        lr=1.0,
        min_lr_ratio=0.1,
        lr_schedule=schedule,  # type: ignore[arg-type]
        lr_decay_fraction=0.3,
        lr_decay_shape=shape,  # type: ignore[arg-type]
    )
    return Config(train=t)


COS_7_8 = 0.5 * (1 + math.cos(7 * math.pi / 8))
CASES = [  # (schedule, shape, {step: lr})
    ("cosine", "1-sqrt", {0: 0.5, 1: 1.0, 2: 1.0, 6: 0.1 + 0.9 * 0.5, 9: 0.1 + 0.9 * COS_7_8}),
    ("linear", "1-sqrt", {0: 0.5, 2: 1.0, 6: 0.1 + 0.9 * 0.5, 9: 0.1 + 0.9 / 8}),
    ("constant", "1-sqrt", {0: 0.5, 1: 1.0, 5: 1.0, 9: 1.0}),
    ("wsd", "1-sqrt", {0: 0.5, 2: 1.0, 6: 1.0, 7: 1.0, 8: 0.1 + 0.9 * (1 - math.sqrt(1 / 3))}),
    ("wsd", "1-sqrt", {9: 0.1 + 0.9 * (1 - math.sqrt(2 / 3))}),
    ("wsd", "linear", {6: 1.0, 7: 1.0, 8: 0.1 + 0.9 * (2 / 3), 9: 0.1 + 0.9 / 3}),
    ("wsd", "cosine", {7: 1.0, 8: 0.1 + 0.9 * 0.75, 9: 0.1 + 0.9 * 0.25}),
]


@pytest.mark.parametrize(("schedule", "shape", "want"), CASES)
def test_schedule_equals_its_formula(schedule: str, shape: str, want: dict[int, float]) -> None:
    cfg = _cfg(schedule, shape)
    for step, lr in want.items():
        assert lr_at(step, cfg) == pytest.approx(lr, rel=1e-12), f"{schedule}/{shape} step {step}"


def test_schedule_refusals() -> None:
    with pytest.raises(ConfigError, match=r"do not fit in train\.steps 10"):
        TrainConfig(steps=10, warmup_steps=8, lr_schedule="wsd", lr_decay_fraction=0.3)
    with pytest.raises(ConfigError, match=r"lr_decay_fraction must be in \(0, 1\]"):
        TrainConfig(lr_decay_fraction=0.0)
    with pytest.raises(ConfigError, match="lr_decay_shape"):
        TrainConfig(lr_decay_shape="sqrt")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="lr_schedule"):
        TrainConfig(lr_schedule="step")  # type: ignore[arg-type]


def test_small_validation_set_is_padded_with_ignored_targets() -> None:
    """3 windows, global batch 8 over dp 2: rank 0 holds windows 0-2 and a filler, rank
    1 four fillers; every filler's targets are ignored."""
    data = TokenDataset(np.arange(100, dtype=np.uint16), seq_len=32)  # 3 windows
    got = []
    for rank in range(2):
        v = Validation(data, 8, 4, rank, 2, seed=1)
        (batch,) = list(v.batches())
        got.append(batch)
    (x0, y0), (x1, y1) = got
    assert x0.shape == y0.shape == x1.shape == (4, 32)
    assert x0[:3, 0].tolist() == [0, 32, 64] and (y0[:3] >= 0).all()
    assert bool((y0[3] == -100).all()) and bool((y1 == -100).all())
    assert "3 window(s), fewer than one global batch of 8" in v.describe()


def _rows(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_wsd_resumes_mid_schedule_and_small_validation_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 6-step WSD run (1 warm-up, linear decay over the last 3) checkpointed at step 3,
    with a validation set smaller than one global batch, evaluated; resumed from step 3,
    steps 4-6 have the uninterrupted run's learning rates, each its formula; plot draws
    the run."""
    flags = [*tiny_args(max_bytes=30_000), "--nproc", "1", "--steps", "6", "--lr", "0.01"]
    flags += ["--train.warmup_steps", "1", "--train.lr_schedule", "wsd"]
    flags += ["--train.lr_decay_fraction", "0.5", "--train.lr_decay_shape", "linear"]
    flags += ["--data.val_fraction", "0.005", "--train.eval_every", "3"]
    ckpt = tmp_path / "ckpt"
    run = [*flags, "--train.checkpoint_dir", str(ckpt), "--train.checkpoint_every", "3"]
    assert main(["train", *run, "--log.dir", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "fewer than one global batch of 8: all evaluated together" in out
    assert "1 warm-up step(s), then wsd: stable until step 3, linear decay over 3 step(s)" in out
    full = _rows(tmp_path / "a" / "metrics.jsonl")
    peak, low = 0.01, 0.001
    want = [peak * 1.0, peak, peak, peak, low + (peak - low) * 2 / 3, low + (peak - low) / 3]
    assert [r["lr"] for r in full] == pytest.approx(want, rel=1e-12)
    vals = [r["val_loss"] for r in full if r.get("val_loss") is not None]
    assert len(vals) == 2 and all(math.isfinite(v) for v in vals)
    resumed = [*flags, "--resume", str(ckpt / step_dirname(3)), "--log.dir", str(tmp_path / "b")]
    assert main(["train", *resumed]) == 0
    tail = _rows(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in tail] == [4, 5, 6]
    assert [r["lr"] for r in tail] == [r["lr"] for r in full[3:]]
    assert [r["loss"] for r in tail] == pytest.approx([r["loss"] for r in full[3:]], rel=1e-6)
    png = tmp_path / "lr.png"
    assert main(["plot", str(tmp_path / "a" / "metrics.jsonl"), "-o", str(png)]) == 0
    assert png.stat().st_size > 20_000
