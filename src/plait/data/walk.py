"""The one file-walking rule of a folder source, shared by ``plait data prepare DIR`` and
``plait train --data DIR``.

A folder is read recursively in sorted order of relative POSIX path. Skipped:

* hidden entries (a name starting with ``.``) and ``__pycache__`` folders;
* entries that are not regular files (FIFOs, sockets, devices: reading them would block);
* binary files: a NUL byte, or bytes that are not UTF-8, in the first :data:`PEEK` bytes
  (JSONL and parquet files are told by their suffix and never skipped as binary).

:func:`walk` returns the files kept and the files skipped as binary, so a caller can say
what it skipped.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Collection
from pathlib import Path

PEEK = 1 << 16
"""Bytes of a file read to tell text from binary."""

SKIP_DIRS = frozenset({"__pycache__"})
"""Folders never entered (besides hidden ones)."""

STRUCTURED = (".jsonl", ".ndjson", ".parquet")
"""Suffixes read by their format, never tested for text."""


def is_binary(path: Path) -> bool:
    """Whether the first :data:`PEEK` bytes of ``path`` hold a NUL byte or are not UTF-8
    (a multi-byte character cut by the peek is not counted)."""
    with path.open("rb") as f:
        head = f.read(PEEK)
        more = f.read(1) != b""
    if b"\x00" in head:
        return True
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=not more)
    except UnicodeDecodeError:
        return True
    return False


def walk(
    root: Path, suffix: str | None = None, skip_dirs: Collection[str] = SKIP_DIRS
) -> tuple[list[Path], list[Path]]:
    """``(files, skipped_binary)`` under ``root`` by the rule above, both sorted by relative
    path; ``suffix`` keeps only names ending with it; ``skip_dirs`` are folder names not
    entered."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in skip_dirs]
        for name in filenames:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            p = Path(dirpath) / name
            if p.is_file():  # FIFOs, sockets, devices: never read
                found.append(p)
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    files: list[Path] = []
    binary: list[Path] = []
    for p in found:
        if not p.name.lower().endswith(STRUCTURED) and p.stat().st_size and is_binary(p):
            binary.append(p)
        else:
            files.append(p)
    return files, binary


def skipped_note(root: Path, skipped: list[Path], limit: int = 5) -> str | None:
    """One line naming the binary files skipped under ``root`` (None when there are none)."""
    if not skipped:
        return None
    names = [p.relative_to(root).as_posix() for p in skipped[:limit]]
    more = f" and {len(skipped) - limit} more" if len(skipped) > limit else ""
    return f"skipped {len(skipped)} binary file(s) under {root}: {', '.join(names)}{more}"
