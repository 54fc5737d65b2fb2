"""The checkpoint folder's lock, its stale-lock takeover, and the start checks."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from plait.checkpoint import CheckpointError, CheckpointLockedError, FolderLock
from plait.checkpoint.folder import LOCK_NAME, check_folder, lock_holder, remove_temporaries


def test_second_holder_is_refused_naming_the_first(tmp_path: Path) -> None:
    with FolderLock(tmp_path) as first:
        assert first.held
        info = json.loads((tmp_path / LOCK_NAME).read_text())
        assert info["pid"] == os.getpid() and info["host"]
        assert lock_holder(tmp_path) == info
        held = rf"in use by another job: host .*pid {os.getpid()}"
        with pytest.raises(CheckpointLockedError, match=held):
            FolderLock(tmp_path).acquire()
    assert not (tmp_path / LOCK_NAME).exists()  # released: the file is gone
    assert lock_holder(tmp_path) is None
    with FolderLock(tmp_path):  # free again
        pass


def _take_and_die(root: str) -> None:
    FolderLock(root).acquire()
    os._exit(0)  # dies holding it: the kernel drops the flock, the file stays


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path: Path) -> None:
    proc = mp.get_context("fork").Process(target=_take_and_die, args=(str(tmp_path),))
    proc.start()
    proc.join(timeout=60)
    dead = json.loads((tmp_path / LOCK_NAME).read_text())["pid"]
    assert dead == proc.pid
    assert lock_holder(tmp_path) is None  # a stale file does not count as held
    with (
        pytest.warns(RuntimeWarning, match=rf"stale lock .*pid {dead}.* no longer running"),
        FolderLock(tmp_path),
    ):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_check_folder_refuses_unwritable_and_full(tmp_path: Path) -> None:
    check_folder(tmp_path / "new", 1000)  # created
    assert (tmp_path / "new").is_dir() and not list((tmp_path / "new").iterdir())
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match=r"file/ck is not writable"):
        check_folder(blocker / "ck", 1000)
    with pytest.raises(CheckpointError, match=r"exists and is not a folder"):
        check_folder(blocker, 1000)
    need = r"bytes free, but one checkpoint needs about 10,000,000,000,000,000,000 bytes"
    with pytest.raises(CheckpointError, match=need):
        check_folder(tmp_path, 10**19)


def test_remove_temporaries(tmp_path: Path) -> None:
    for name in (".tmp-step_00000003", ".old-step_00000002", "step_00000001"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank00000.safetensors").write_bytes(b"x")
    gone = remove_temporaries(tmp_path)
    assert sorted(p.name for p in gone) == [".old-step_00000002", ".tmp-step_00000003"]
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]
