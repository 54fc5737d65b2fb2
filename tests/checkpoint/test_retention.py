"""Retention counts only verified checkpoints and never deletes the good ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from plait import init_mesh
from plait.checkpoint import CheckpointReader, read_latest, step_dirname
from plait.checkpoint.folder import prune
from plait.train.trainer import Trainer
from tests.checkpoint.test_checkpoint import config


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints at steps 2, 4 and 6 of the tiny run."""
    root = tmp_path_factory.mktemp("three")
    Trainer(config(str(root), steps=6, every=2), init_mesh(), show_progress=False).run()
    return root


def _corrupt(folder: Path) -> None:
    shard = folder / "rank00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))


def test_prune_counts_only_verified_and_keeps_the_newest_good(three: Path, tmp_path: Path) -> None:
    root = Path(shutil.copytree(three, tmp_path / "ck"))
    _corrupt(root / step_dirname(6))
    (root / ".tmp-step_00000008").mkdir()
    gone = prune(root, keep=1)
    # the corrupt newest is not counted: step 4 (newest verified) stays, 2 goes; the
    # corrupt one newer than every good one is left for a person to look at
    assert _names(root) == [step_dirname(4), step_dirname(6)]
    assert {p.name for p in gone} == {step_dirname(2), ".tmp-step_00000008"}
    # a corrupt one older than the newest verified is deleted
    root2 = Path(shutil.copytree(three, tmp_path / "ck2"))
    _corrupt(root2 / step_dirname(2))
    prune(root2, keep=2)
    assert _names(root2) == [step_dirname(4), step_dirname(6)]
    # protect keeps a folder whatever keep says
    root3 = Path(shutil.copytree(three, tmp_path / "ck3"))
    prune(root3, keep=1, protect=[step_dirname(2)])
    assert _names(root3) == [step_dirname(2), step_dirname(6)]


def test_resume_after_fallback_keeps_the_checkpoint_it_resumed_from(
    three: Path, tmp_path: Path
) -> None:
    """The issue's case: step 6 is corrupt, the run falls back to step 4, stops at 5
    with keep 1. The old rule kept the corrupt 6 and deleted 4."""
    root = Path(shutil.copytree(three, tmp_path / "ck"))
    _corrupt(root / step_dirname(6))
    cfg = config(str(root), steps=5, every=0, resume="latest")
    cfg.train.keep_checkpoints = 1
    with pytest.warns(RuntimeWarning, match="resuming from step_00000004"):
        tr = Trainer(cfg, init_mesh(), show_progress=False)
    assert tr.start_step == 4
    tr.run()
    assert _names(root) == [step_dirname(4), step_dirname(5), step_dirname(6)]
    assert read_latest(root) == root / step_dirname(5)
    assert CheckpointReader(root / step_dirname(4)).step == 4  # still verified
    assert CheckpointReader(root / step_dirname(5)).step == 5
