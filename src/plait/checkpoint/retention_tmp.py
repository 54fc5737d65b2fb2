"""Which checkpoints to keep: only verified ones count, and the good ones are safe.

After every save rank 0 prunes the checkpoint folder (``train.keep_checkpoints``):

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

import shutil
from collections.abc import Iterable
from pathlib import Path

from plait.train.checkpoint_lock import remove_temporaries
from plait.train.checkpoint_meta import (
    CheckpointError,
    CorruptCheckpointError,
    list_steps,
    read_metadata,
    verify_files,
)


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
        kept |= {p.name for p in good[-max(1, keep):]}
        doomed += [p for p in good if p.name not in kept]
        newest = int(good[-1].name.split("_")[-1])
        doomed += [p for step, p in bad if step < newest and p.name not in kept]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
        if trusted is not None:
            trusted.discard(p.name)
    return doomed + remove_temporaries(root)
