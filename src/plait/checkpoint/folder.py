"""The checkpoint folder: one job at a time, room to write, and which checkpoints stay.

**The lock.** Rank 0 of a run that saves checkpoints takes ``<checkpoint_dir>/.lock``
before training starts and holds it until it exits. The file names its holder (host,
pid, job id, start time, as JSON); the lock itself is an exclusive ``flock`` on the open
file, which the kernel drops when the holder dies however it dies (kill -9 included). So:

* a second job finds the lock taken and is refused before it trains, naming the holder;
* a lock file left by a dead process is *stale*: its ``flock`` is free, so it is taken
  over with a warning naming the dead holder.

:func:`check_folder` proves before training that the folder is writable and has room for
one checkpoint plus a margin, and :func:`remove_temporaries` removes the temporary
folders of abandoned saves.

**Retention.** After every save rank 0 prunes the checkpoint folder
(``train.keep_checkpoints``, :func:`prune`):

* only **verified** checkpoints count towards the limit: a folder whose metadata and
  every shard's sha256 check out (checked once per run; the ones this run wrote and the
  one it resumed from are known good);
* the newest ``keep`` verified checkpoints stay, and so do, whatever ``keep`` says, the
  **newest verified** one and every folder in ``protect`` (the one the run resumed from,
  the one just written);
* a corrupt checkpoint older than the newest verified one is deleted (a resume would
  never pick it); one newer than that is left for a person to look at; a folder of
  another format version is neither counted nor deleted;
* temporary folders of interrupted saves (``.tmp-*``, ``.old-*``) are deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from plait.checkpoint.files import verify_files
from plait.checkpoint.format import (
    CheckpointError,
    CorruptCheckpointError,
    list_steps,
    read_metadata,
)

LOCK_NAME = ".lock"
"""The lock file inside a checkpoint folder."""


MARGIN_BYTES = 64 << 20
"""Free space asked for beyond one checkpoint (plus 10 % of its size)."""


_TEMP_PATTERNS = (".tmp-*", ".old-*")


class CheckpointLockedError(CheckpointError):
    """The checkpoint folder is held by another running job."""


def job_id() -> str:
    """The scheduler's job id when there is one (Slurm, PBS, LSF, torchrun's run id)."""
    for var in ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    return "-"


def describe_holder(info: dict[str, Any]) -> str:
    """``host h, pid p, job j (since ...)`` of a lock file's content."""
    since = info.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
    return (
        f"host {info.get('host', '?')}, pid {info.get('pid', '?')}, job {info.get('job', '-')} "
        f"(since {when})"
    )


def _read_info(path: Path) -> dict[str, Any]:
    try:
        info = json.loads(path.read_text("utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


class FolderLock:
    """The advisory lock of one checkpoint folder (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.path = self.root / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise :class:`CheckpointLockedError` naming the holder; a
        stale lock (its holder is dead) is taken over with a warning."""
        import fcntl

        self.root.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                info = _read_info(self.path)
                raise CheckpointLockedError(
                    f"checkpoint folder {self.root} is in use by another job: "
                    f"{describe_holder(info)}; wait for it to finish, stop it, or give this "
                    "run another train.checkpoint_dir"
                ) from None
            try:  # the file we locked may have been removed by a holder that just left
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        old = _read_info(self.path)
        if old:
            warnings.warn(
                f"taking over the stale lock of {self.root}: its holder ({describe_holder(old)}) "
                "is no longer running",
                RuntimeWarning,
                stacklevel=2,
            )
        mine = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "job": job_id(),
            "since": time.time(),
        }
        data = json.dumps(mine).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file and drop the lock (nothing when not held)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)  # closing drops the flock
        self._fd = None

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_holder(root: str | Path) -> dict[str, Any] | None:
    """The holder of ``root``'s lock when a live process holds it, else None (no file,
    or a stale one). Probes with a shared ``flock`` that is dropped at once."""
    import fcntl

    path = Path(root) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return _read_info(path) or {"host": "?"}
    finally:
        os.close(fd)
    return None


def remove_temporaries(root: str | Path) -> list[Path]:
    """Delete the temporary folders of abandoned saves (``.tmp-*``, ``.old-*``)."""
    r = Path(root)
    gone = [p for pat in _TEMP_PATTERNS for p in r.glob(pat) if p.is_dir()]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def _temporary_bytes(root: Path) -> int:
    total = 0
    for pat in _TEMP_PATTERNS:
        for d in root.glob(pat):
            for f in d.rglob("*"):
                with contextlib.suppress(OSError):
                    total += f.stat().st_size if f.is_file() else 0
    return total


def needed_bytes(checkpoint_bytes: int) -> int:
    """Free space asked for: one checkpoint, 10 % more, and :data:`MARGIN_BYTES`."""
    return int(checkpoint_bytes * 1.1) + MARGIN_BYTES


def check_folder(root: str | Path, checkpoint_bytes: int) -> None:
    """Refuse (CheckpointError, exit 2) a checkpoint folder that cannot be created or
    written, or whose file system has less free space than one checkpoint plus a margin
    (temporaries of abandoned saves count as free: the run removes them once it holds the
    folder's lock)."""
    r = Path(root)
    if r.exists() and not r.is_dir():
        raise CheckpointError(f"train.checkpoint_dir {r} exists and is not a folder")
    try:
        r.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=r)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CheckpointError(
            f"train.checkpoint_dir {r} is not writable ({e.strerror or e}); give a folder "
            "this job can write to"
        ) from None
    free = shutil.disk_usage(r).free + _temporary_bytes(r)
    need = needed_bytes(checkpoint_bytes)
    if free < need:
        raise CheckpointError(
            f"train.checkpoint_dir {r} has {free:,} bytes free, but one checkpoint needs about "
            f"{checkpoint_bytes:,} bytes ({need:,} with the margin); free some space or give "
            "another folder"
        )


# ---------------------------------------------------------------------------- retention


def is_verified(folder: Path, trusted: set[str] | None = None) -> bool | None:
    """True: the checkpoint checks out (its name is added to ``trusted``); False: it is
    corrupt (missing or altered files); None: not a checkpoint this plait can read."""
    if trusted is not None and folder.name in trusted:
        return True
    try:
        verify_files(folder, read_metadata(folder))
    except CorruptCheckpointError:
        return False
    except CheckpointError:
        return None
    if trusted is not None:
        trusted.add(folder.name)
    return True


def prune(
    root: Path, keep: int, protect: Iterable[str] = (), trusted: set[str] | None = None
) -> list[Path]:
    """Apply the retention rules of the module docstring under ``root``; returns what was
    deleted. ``protect``: folder names never deleted; ``trusted``: names known verified
    (grown with the ones verified here, so each is hashed once per run)."""
    root = Path(root)
    kept = set(protect)
    good: list[Path] = []
    bad: list[tuple[int, Path]] = []
    for step, folder in list_steps(root):
        ok = is_verified(folder, trusted)
        if ok:
            good.append(folder)
        elif ok is False:
            bad.append((step, folder))
    doomed: list[Path] = []
    if good:
        kept |= {p.name for p in good[-max(1, keep) :]}
        doomed += [p for p in good if p.name not in kept]
        newest = int(good[-1].name.split("_")[-1])
        doomed += [p for step, p in bad if step < newest and p.name not in kept]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
        if trusted is not None:
            trusted.discard(p.name)
    return doomed + remove_temporaries(root)
