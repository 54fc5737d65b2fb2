"""The documents of a ``plait data prepare`` source, in a fixed order.

A source is a file or a folder (read by the rule ``plait train --data DIR`` uses too,
:mod:`plait.data.walk`: recursively, sorted by relative path, hidden entries,
``__pycache__`` and binary files skipped; :func:`plan_source` returns what it skipped).
Each file is read by its kind:

* ``.jsonl`` / ``.ndjson``: one JSON object per line, the document is its ``field``;
* ``.parquet``: one document per row, the column ``field`` (pyarrow);
* a folder saved by Hugging Face ``datasets`` (``save_to_disk``: ``state.json`` or
  ``dataset_dict.json`` inside): one document per row of ``field`` (its ``train`` split
  when it holds several), via ``datasets.load_from_disk`` (the optional extra ``data``);
* anything else: a UTF-8 text file, the whole file one document.

:func:`plan_source` checks everything it can before any work (the source exists and is
not empty, every file opens, JSONL's first record and parquet's schema have ``field``,
text files are UTF-8); a later bad record stops the run with the file and line named.
Every problem is a :class:`~plait.errors.DataError` (exit code 2) naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from plait.data.walk import walk
from plait.errors import DataError, install_hint

JSONL = (".jsonl", ".ndjson")
"""Suffixes read as JSON lines."""

PARQUET = (".parquet",)
"""Suffixes read as parquet."""


@dataclass(frozen=True)
class SourceFile:
    """One file (or saved dataset folder) of a source and how to read it."""

    path: Path
    kind: str  # "text" | "jsonl" | "parquet" | "hf-dataset"


def is_hf_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``datasets``' ``save_to_disk``."""
    return path.is_dir() and any((path / n).is_file() for n in ("state.json", "dataset_dict.json"))


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL):
        return "jsonl"
    if name.endswith(PARQUET):
        return "parquet"
    return "text"


def _load_hf(path: Path, field: str):  # type: ignore[no-untyped-def]
    try:
        import datasets
    except ImportError as exc:
        raise DataError(
            f"{path} is a Hugging Face datasets folder; reading it needs the datasets "
            f"package: install it with {install_hint('data', 'datasets')}."
        ) from exc
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises many types for a bad folder
        raise DataError(f"{path}: datasets.load_from_disk failed ({exc}).") from exc
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(
                f"{path} holds the splits {sorted(ds)} and no 'train'; give one split's folder."
            )
        ds = ds["train"]
    if field not in ds.column_names:
        raise DataError(f"{path}: no column {field!r} (columns: {ds.column_names}); use --field.")
    return ds


def _check_file(f: SourceFile, field: str | None) -> None:
    """Open ``f`` and check what can be checked cheaply (see the module's docstring)."""
    if f.kind == "hf-dataset":
        if field is not None:
            _load_hf(f.path, field)
        return
    try:
        with f.path.open("rb") as fh:
            head = fh.read(1 << 16)
    except OSError as exc:
        raise DataError(f"{f.path}: cannot read it ({exc.strerror or exc}).") from exc
    if f.kind == "jsonl":
        first = next((ln for ln in head.splitlines() if ln.strip()), None)
        if field is not None and first is not None and len(first) < len(head):
            _record(first, f.path, 1, field)
    elif f.kind == "parquet" and field is not None:
        import pyarrow.parquet as pq

        try:
            names = pq.ParquetFile(f.path).schema_arrow.names
        except Exception as exc:  # pyarrow raises ArrowInvalid, OSError ...
            raise DataError(f"{f.path}: not a readable parquet file ({exc}).") from exc
        if field not in names:
            raise DataError(f"{f.path}: no column {field!r} (columns: {names}); use --field.")
    elif f.kind == "text":
        _text(f.path, head)


def plan_source(src: str | Path, field: str | None) -> tuple[list[SourceFile], list[Path]]:
    """``(files, skipped)``: the files of ``src`` in reading order, checked (DataError naming
    the file), and the binary files of a folder that the shared rule skipped. ``field``
    None: records are checked as they are read (chat data)."""
    root = Path(src).expanduser()
    if not root.exists():
        raise DataError(f"{root} does not exist; give a text, JSONL or parquet file or a folder.")
    skipped: list[Path] = []
    if is_hf_dataset(root):
        files = [SourceFile(root, "hf-dataset")]
    elif root.is_dir():
        kept, skipped = walk(root)
        files = [SourceFile(p, _kind(p)) for p in kept]
    elif root.is_file():
        files = [SourceFile(root, _kind(root))]
    else:
        raise DataError(f"{root} is neither a regular file nor a folder.")
    if not files:
        raise DataError(
            f"{root} is empty: no files to read (hidden and binary files are skipped"
            f"{f'; {len(skipped)} binary' if skipped else ''})."
        )
    for f in files:
        _check_file(f, field)
    if all(f.kind != "hf-dataset" and f.path.stat().st_size == 0 for f in files):
        raise DataError(f"{root} is empty: every file is 0 bytes.")
    return files, skipped


def _text(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if len(data) == 1 << 16 and exc.start > len(data) - 4:  # a character cut by the peek
            return ""
        raise DataError(
            f"{path}: not UTF-8 text (byte {exc.start}); give text, .jsonl or .parquet files."
        ) from exc


def _record(line: bytes, path: Path, lineno: int, field: str) -> str:
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise DataError(f"{path}:{lineno}: not a JSON object ({exc}).") from exc
    if not isinstance(obj, dict) or field not in obj:
        raise DataError(f"{path}:{lineno}: no field {field!r} in the record; use --field.")
    value = obj[field]
    if not isinstance(value, str):
        raise DataError(f"{path}:{lineno}: field {field!r} is {type(value).__name__}, not text.")
    return value


def iter_documents(files: list[SourceFile], field: str) -> Iterator[str]:
    """Every document of ``files``, in order (empty documents included)."""
    for f in files:
        if f.kind == "text":
            try:
                data = f.path.read_bytes()
            except OSError as exc:
                raise DataError(f"{f.path}: cannot read it ({exc.strerror or exc}).") from exc
            yield _text(f.path, data) if data else ""
        elif f.kind == "jsonl":
            with f.path.open("rb") as fh:
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        yield _record(line, f.path, n, field)
        elif f.kind == "parquet":
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(f.path).iter_batches(columns=[field], batch_size=1024):
                for v in batch.column(0).to_pylist():
                    yield "" if v is None else str(v)
        else:
            ds = _load_hf(f.path, field)
            for rows in ds.iter(batch_size=1024):
                for v in rows[field]:
                    yield "" if v is None else str(v)
