"""`plait plot`: two runs' metrics in one PNG; bad input exits 2 naming the file.

The runs here are metrics files written by `plait train` itself (one process, a few
tiny steps, evaluation on), so the picture is drawn from what training really writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from plait.cli import main
from plait.cli.plot import run_label
from tests.tiny import tiny_args


def _run(folder: Path, lr: str) -> Path:
    args = [*tiny_args(max_bytes=60_000), "--nproc", "1", "--steps", "4", "--lr", lr]
    args += ["--train.eval_every", "2", "--log.dir", str(folder), "--progress", "none"]
    assert main(["train", *args]) == 0
    return folder / "metrics.jsonl"  # the default metrics file under log.dir


def test_plot_two_runs_writes_a_picture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _run(tmp_path / "lr3e-3", "3e-3"), _run(tmp_path / "lr1e-2", "1e-2")
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    out = tmp_path / "cmp.png"
    assert main(["plot", str(a), str(b), "-o", str(out)]) == 0
    assert f"wrote {out} (2 run(s))" in capsys.readouterr().out
    assert out.stat().st_size > 20_000  # four panels with curves, not an empty canvas
    pixels = imread(out)  # (height, width, channels) floats in [0, 1]
    assert pixels.shape[0] >= 500 and pixels.shape[1] >= 800
    assert pixels.std() > 0.05 and len(np.unique(pixels.reshape(-1, pixels.shape[2]), axis=0)) > 50
    assert run_label(a) == "lr3e-3" and run_label(tmp_path / "x.jsonl") == "x"


def test_plot_bad_inputs_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    assert main(["plot", str(bad)]) == 2
    assert "bad.jsonl:2 is not a JSON line" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["plot", str(empty)]) == 2
    assert "holds no rows" in capsys.readouterr().err
    assert main(["plot", str(bad), "--label", "a", "--label", "b"]) == 2
