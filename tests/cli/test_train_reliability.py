"""`plait train` and friends refuse what would fail later, before any work, with exit 2.

Also: a finished run re-submitted exits 0; a resume that would change the data order
(seed, global batch) is refused through the CLI; a folder held by another job is
refused naming the holder; warnings print as one ``plait: warning:`` line.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from pathlib import Path

import numpy as np
import pytest

from plait.checkpoint import FolderLock, step_dirname
from plait.checkpoint.folder import LOCK_NAME
from plait.checkpoint.format import list_steps
from plait.cli import main
from tests.tiny import run_plait, tiny_args

TINY = tiny_args()


def _bad(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("plait: error: ")
    return err


@pytest.fixture(scope="module")
def done(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint folder of a finished 2-step run."""
    d = tmp_path_factory.mktemp("done") / "ck"
    assert main(["train", *TINY, "--steps", "2", "--train.checkpoint_dir", str(d)]) == 0
    return d


def test_finished_run_resubmitted_exits_0(done: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = sorted(p.name for p in done.iterdir())
    for steps in ("2", "1"):
        args = ["train", *TINY, "--steps", steps, "--train.checkpoint_dir", str(done)]
        assert main([*args, "--resume", "auto"]) == 0
        out = capsys.readouterr().out
        assert "the run is already complete" in out and "at step 2" in out
    assert sorted(p.name for p in done.iterdir()) == before  # nothing written


@pytest.mark.parametrize(
    ("flag", "value", "field"),
    [("--seed", "7", "train.seed = 0"), ("--global-batch", "16", "train.global_batch = 8")],
)
def test_resume_with_another_seed_or_batch_is_refused(
    done: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, field: str
) -> None:
    args = ["train", *TINY, "--steps", "4", "--train.checkpoint_dir", str(done), "--resume"]
    err = _bad([*args, flag, value], capsys)
    assert f"it was written with {field}" in err and "data order would change" in err


def test_folder_held_by_another_job_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "ck"
    metrics = tmp_path / "m.jsonl"
    with FolderLock(ck):
        args = ["train", *TINY, "--steps", "2", "--train.checkpoint_dir", str(ck)]
        err = _bad([*args, "--metrics", str(metrics)], capsys)
    assert f"checkpoint folder {ck} is in use by another job" in err
    assert f"pid {os.getpid()}" in err
    assert not metrics.exists() and not list_steps(ck)  # refused before training


def _take_and_die(root: str) -> None:
    FolderLock(root).acquire()
    os._exit(0)


def test_stale_lock_warning_is_one_line_without_source_path(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    proc = mp.get_context("fork").Process(target=_take_and_die, args=(str(ck),))
    proc.start()
    proc.join(timeout=60)
    r = run_plait(["train", *TINY, "--steps", "1", "--train.checkpoint_dir", str(ck)], tmp_path)
    assert r.returncode == 0, r.stderr
    warning = [ln for ln in r.stderr.splitlines() if "stale lock" in ln]
    assert len(warning) == 1
    assert warning[0].startswith(
        f"plait: warning: taking over the stale lock of {ck}: its holder (host "
        f"{socket.gethostname()}, pid {proc.pid}, job "
    )
    assert warning[0].endswith("is no longer running")
    assert ".py" not in r.stderr and "warnings.warn" not in r.stderr
    assert (ck / step_dirname(1)).is_dir() and not (ck / LOCK_NAME).exists()


def test_unwritable_or_full_checkpoint_folder_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    metrics = tmp_path / "m.jsonl"
    args = ["train", *TINY, "--steps", "2", "--metrics", str(metrics)]
    err = _bad([*args, "--train.checkpoint_dir", str(blocker / "ck")], capsys)
    assert f"{blocker / 'ck'} is not writable" in err
    # a model whose checkpoint cannot fit on any disk (never built: refused first)
    huge = ["--model.dim", "65536", "--model.n_layers", "4096", "--launch.check_memory", "false"]
    err = _bad([*args, *huge, "--train.checkpoint_dir", str(tmp_path / "ck")], capsys)
    assert "bytes free, but one checkpoint needs about" in err and str(tmp_path / "ck") in err
    assert not metrics.exists()


def test_token_ids_outside_the_vocabulary_are_refused_at_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "tokens.npy"
    ids = np.arange(4000, dtype=np.int32) % 200
    ids[77] = -3
    np.save(data, ids)
    err = _bad(["train", *TINY, "--steps", "1", "--data", str(data)], capsys)
    assert f"{data}: token id -3 (at position 77)" in err and "vocab_size = 256" in err


def test_fifo_data_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    err = _bad(["train", *TINY, "--steps", "1", "--data", str(fifo)], capsys)
    assert "neither a regular file nor a folder" in err


def test_output_paths_are_checked_up_front(
    done: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "adir"
    d.mkdir()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "is a folder" in _bad(["train", *TINY, "--steps", "1", "--metrics", str(d)], capsys)
    assert "is a folder" in _bad(["pipeline", "draw", "--out", str(d)], capsys)
    err = _bad(["checkpoint", "consolidate", str(done), "-o", str(d)], capsys)
    assert "is a folder" in err
    err = _bad(["ps-train", "--records", str(blocker / "rec")], capsys)
    assert "--records" in err and "is a file, not a folder" in err
    assert sorted(p.name for p in d.iterdir()) == []  # no temporary file left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "file"]


def test_plan_and_pipeline_draw_are_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any enumeration or simulation (each used to run for minutes)."""
    assert "more than the planner models" in _bad(["plan", "--params", "1e30", "--search"], capsys)
    err = _bad(["plan", "--params", "7e9", "--devices", "1000000000", "--search"], capsys)
    assert "more than the planner searches" in err
    err = _bad(["plan", "--params", "1e12", "--devices", "14414400", "--search"], capsys)
    assert "layouts, more than the 150,000 a search walks" in err
    err = _bad(["pipeline", "draw", "--stages", "500", "--microbatches", "999"], capsys)
    assert "more than the 200000 this command simulates" in err
    err = _bad(["pipeline", "draw", "--stages", "100", "--microbatches", "101"], capsys)
    assert "more than the 20000 a chart shows" in err
