"""``plait tune``: search specs, and a 2 x 2 grid of tiny 2-rank trials on Ray Tune.

The grid runs in this process on the session's Ray instance (``ray_instance``, 4 CPUs),
every trial to the end (``--scheduler fifo``), so that each trial's final loss is its
step-3 loss and the best can be checked against the table. The trials are one-rank runs
(four at once) to keep the test short on 2 cores: a 2-rank trial is the same command with
``--nproc 2`` (plait's launcher, tested on its own); ``docs/ray.md``'s example runs them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

from plait.cli import main as plait_main
from plait.errors import ConfigError
from plait.launch.ray_tune import SearchItem, parse_search
from tests.tiny import tiny_args


def test_search_specs_parse_to_grids_and_samplers() -> None:
    assert parse_search("train.lr=1e-4,3e-4") == SearchItem("train.lr", ("1e-4", "3e-4"))
    assert parse_search("train.lr=loguniform(1e-4, 1e-2)") == SearchItem(
        "train.lr", ("1e-4", "1e-2"), "loguniform"
    )
    assert parse_search("parallel.zero=choice(1,3)").sampler == "choice"
    for bad in ("lr=1", "train.lr=", "train.lr=uniform(1)", "train.lr=randint(a,b)"):
        with pytest.raises(ConfigError):
            parse_search(bad)


def test_an_invalid_trial_is_refused_before_any_trial_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = plait_main(["tune", "--search", "parallel.zero=1,7", "--steps", "2"])
    assert code == 2
    assert "parallel.zero=7 is invalid" in capsys.readouterr().err


@pytest.mark.slow
def test_a_2x2_grid_reports_four_trials_and_the_best_has_the_lowest_loss(
    ray_instance: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["tune", "--search", "train.lr=1e-3,3e-3", "--search", "train.seed=0,1"]
    args += ["--scheduler", "fifo", "--out", str(tmp_path / "t"), "--nproc", "1"]
    args += [*tiny_args(max_bytes=100_000), "--steps", "3", "--launch.threads", "1"]
    assert plait_main(args) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^(\de-3)\s+(\d)\s+(\d+\.\d+)\s+[\d,]+\s+3\s+done\s*$", out, re.M)
    assert len(rows) == 4, out
    assert {(lr, seed) for lr, seed, _ in rows} == {
        (lr, seed) for lr in ("1e-3", "3e-3") for seed in ("0", "1")
    }
    lr, seed, loss = min(rows, key=lambda r: float(r[2]))
    assert rows[0] == (lr, seed, loss)  # the table is best first
    best = tomllib.loads((tmp_path / "t" / "best.toml").read_text())
    assert best["train"]["lr"] == float(lr) and best["train"]["seed"] == int(seed)
    assert best["train"]["steps"] == 3 and best["model"]["dim"] == 32  # the base run too
