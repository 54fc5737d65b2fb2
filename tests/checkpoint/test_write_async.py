"""Asynchronous saves (``train.async_checkpoint = true``).

* A run saving asynchronously trains exactly as one saving synchronously (same losses,
  bit for bit) and a resume from its checkpoint is bit-exact, in one process and at
  zero3 dp2 (where rank 0's writer waits for rank 1's file before it commits).
* Training continues while the writer runs: the writer of the step-1 save, after it
  wrote its file and before it commits, waits for an event the training thread sets
  when step 2 is done; it gets it (recorded events, no timings; a save on the training
  thread would never see it).
* A SIGKILL during the background write leaves ``latest`` on the previous checkpoint,
  which loads; a writer failing with a full disk (in one process, or on rank 1 of two)
  raises CheckpointSaveError at the next save on every rank and leaves the previous
  checkpoint.
* A read-only (unwritable) folder fails at start, with exit 2, not at the first save.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from plait import init_mesh
from plait.checkpoint import (
    CheckpointReader,
    CheckpointSaveError,
    find_checkpoint,
    read_latest,
    step_dirname,
)
from plait.cli import main
from plait.config import Config
from plait.testing import WorkerContext, WorkerPool
from plait.train.trainer import Trainer
from tests.checkpoint.test_checkpoint import SAVE_AT, _assert_same_weights, _train, config
from tests.tiny import tiny_args

M = "tests.checkpoint.test_write_async"


def async_config(root: str | None, **kw: Any) -> Config:
    cfg = config(root, **kw)
    cfg.train.async_checkpoint = True
    return cfg


def test_async_save_resumes_bit_exact_one_process(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    sync = _train(None, config(str(tmp_path / "sync")))
    full = _train(None, async_config(root))
    assert full["losses"] == sync["losses"]  # saving in the background changes nothing
    assert read_latest(Path(root)) == Path(root) / step_dirname(6)
    assert not list(Path(root).glob(".tmp-*"))
    ck = str(Path(root) / step_dirname(SAVE_AT))
    resumed = _train(None, async_config(root, resume=ck))
    assert resumed["start"] == SAVE_AT
    assert resumed["losses"] == full["losses"][SAVE_AT:]
    _assert_same_weights(resumed["final"], full["final"])


def _pool_body(ctx: WorkerContext, cfg: Config) -> Any:
    out = _train(ctx, cfg)
    return {"losses": out["losses"], "final": out["final"], "start": out["start"]}


def test_async_save_resumes_bit_exact_zero3_dp2(
    pools: Callable[[int], WorkerPool], tmp_path: Path
) -> None:
    root = str(tmp_path / "ck")
    full = pools(2).run(f"{M}:_pool_body", async_config(root, zero=3))
    ck = str(Path(root) / step_dirname(SAVE_AT))
    resumed = pools(2).run(f"{M}:_pool_body", async_config(root, zero=3, resume=ck))
    for f, r in zip(full, resumed, strict=True):
        assert r["start"] == SAVE_AT
        assert r["losses"] == f["losses"][SAVE_AT:]
        _assert_same_weights(r["final"], f["final"])
    assert CheckpointReader(Path(root) / step_dirname(6)).step == 6


def test_training_continues_while_the_writer_runs(tmp_path: Path) -> None:
    step2_done = threading.Event()
    seen: list[str] = []
    trainer = Trainer(async_config(str(tmp_path), steps=3, every=1), init_mesh(), False)
    step = trainer.train_step

    def train_step(k: int) -> Any:
        out = step(k)
        seen.append(f"step {k + 1} done")
        if k + 1 == 2:
            step2_done.set()
        return out

    def hook(name: str) -> None:  # in the writer thread of the step-1 save
        if name == "shard" and threading.current_thread().name == "plait-checkpoint-1":
            # the file of save 1 is written, save 1 not committed: step 2 runs meanwhile
            seen.append(f"writer 1 saw step 2 done: {step2_done.wait(timeout=300)}")

    trainer.train_step = train_step  # type: ignore[method-assign]
    trainer.checkpoints.on_stage = hook
    trainer.run()
    # the writer of save 1, before committing it, saw step 2 finish
    assert "writer 1 saw step 2 done: True" in seen, seen
    assert trainer.checkpoints.writer is not None
    events = trainer.checkpoints.writer.events
    assert events[:2] == [("snapshot", 1), ("written", 1)]
    assert ("committed", 1) in events and events[-1] == ("committed", 3)
    for k in (1, 2):  # at most one save in flight: save k is committed before k + 1 starts
        assert events.index(("committed", k)) < events.index(("snapshot", k + 1))
    assert read_latest(tmp_path) == tmp_path / step_dirname(3)


def _die_in_writer(root: str) -> None:
    """Child: async saves every step; SIGKILL in the writer of the step-2 save."""
    torch.set_num_threads(1)

    def hook(name: str) -> None:
        if name == "shard" and threading.current_thread().name == "plait-checkpoint-2":
            os.kill(os.getpid(), signal.SIGKILL)

    trainer = Trainer(async_config(root, steps=3, every=1), init_mesh(), show_progress=False)
    trainer.checkpoints.on_stage = hook
    trainer.run()
    os._exit(0)


def test_sigkill_during_background_write_leaves_previous_latest(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    proc = mp.get_context("fork").Process(target=_die_in_writer, args=(str(root),))
    proc.start()
    proc.join(timeout=300)
    assert proc.exitcode == -signal.SIGKILL
    assert read_latest(root) == root / step_dirname(1)
    assert list(root.glob(".tmp-*"))  # the killed save's temporary folder
    reader = find_checkpoint("latest", root)
    assert reader is not None and reader.step == 1
    tr = Trainer(async_config(str(root), steps=3, every=1, resume="latest"), init_mesh(), False)
    assert tr.start_step == 1
    tr.run()
    assert read_latest(root) == root / step_dirname(3)
    assert not list(root.glob(".tmp-*"))


def test_writer_failure_raises_at_the_next_save(tmp_path: Path) -> None:
    def hook(name: str) -> None:
        if name == "shard" and threading.current_thread().name == "plait-checkpoint-2":
            raise OSError(errno.ENOSPC, "No space left on device")

    trainer = Trainer(async_config(str(tmp_path), steps=3, every=1), init_mesh(), False)
    trainer.checkpoints.on_stage = hook
    with pytest.raises(CheckpointSaveError, match=r"step_00000002.*No space left"):
        trainer.run()
    assert not list(tmp_path.glob(".tmp-*"))
    assert read_latest(tmp_path) == tmp_path / step_dirname(1)


def test_async_to_an_unwritable_folder_fails_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    args = [
        "train",
        *tiny_args(),
        "--steps",
        "2",
        "--train.async_checkpoint",
        "true",
        "--train.checkpoint_dir",
        str(blocker / "ck"),
        "--train.checkpoint_every",
        "1",
    ]
    capsys.readouterr()
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "loss" not in out  # refused before any step
    assert "is not writable" in err and "Traceback" not in err


def _fail_on_rank1(ctx: WorkerContext, root: str) -> Any:
    """Rank 1's writer of the step-2 save fails (a full disk); every rank must learn it."""
    tr = Trainer(async_config(root, steps=3, every=1, zero=3), ctx.mesh(dp=2), False)

    def hook(name: str) -> None:
        if ctx.rank == 1 and name == "shard" and threading.current_thread().name.endswith("-2"):
            raise OSError(errno.ENOSPC, "No space left on device")

    tr.checkpoints.on_stage = hook
    try:
        tr.run()
    except CheckpointSaveError as e:
        return str(e)
    return None


def test_one_ranks_writer_failing_fails_the_save_on_every_rank(
    pools: Callable[[int], WorkerPool], tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    errors = pools(2).run(f"{M}:_fail_on_rank1", str(root))
    for e in errors:  # rank 1's own error, and rank 0's (its writer gave the save up)
        assert e is not None and "step_00000002" in e and "rank(s) 0, 1" in e, e
        assert "No space left on device" in e, e
    assert read_latest(root) == root / step_dirname(1)  # the previous checkpoint stays
    assert not list(root.glob(".tmp-*"))
    assert CheckpointReader(root / step_dirname(1)).step == 1
