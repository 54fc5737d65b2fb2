"""Corpus sources read whole: the built-in corpus, text files and folders, pre-tokenized
``.npy``/``.bin`` token files (prepared shard folders are :mod:`plait.data.shards`).

Sources (``DataConfig.source``):

* ``"stdlib"``: the running interpreter's standard-library ``.py`` files (always present),
  sorted by relative path, ``site-packages``/``dist-packages`` and test folders skipped;
* a text file, or a folder of text files read recursively in sorted order by the rule
  ``plait data prepare`` uses too (:mod:`plait.data.walk`: hidden entries, ``__pycache__``,
  binary or non-UTF-8 files and entries that are not regular files are skipped);
  a source that is neither a regular file nor a folder (a FIFO) is refused;
* a pre-tokenized ``.npy`` array or raw ``.bin`` array of ``DataConfig.token_dtype``.

Text is read as bytes, joined with :data:`SEPARATOR`, cut at ``DataConfig.max_bytes`` and
tokenized.
"""

from __future__ import annotations

import codecs
import sysconfig
from pathlib import Path

import numpy as np

from plait.config import DataConfig
from plait.data.index import is_prepared
from plait.data.tokenizers import make_tokenizer
from plait.data.walk import SKIP_DIRS, walk
from plait.errors import ConfigError, DataError

SEPARATOR = b"\n\n"
"""Bytes put between two files of a text corpus."""

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


def _read_text(path: Path, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of ``path`` (0: all), or None when it is not UTF-8 text."""
    with path.open("rb") as f:
        data = f.read(limit) if limit > 0 else f.read()
        truncated = limit > 0 and f.read(1) != b""
    if b"\x00" in data:
        return None
    try:  # a cut may split a multi-byte character: only a complete file must end cleanly
        codecs.getincrementaldecoder("utf-8")().decode(data, final=not truncated)
    except UnicodeDecodeError:
        return None
    return data


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def sorted_files(root: Path, suffix: str | None) -> list[Path]:
    """Text files under ``root`` by the shared folder rule (:mod:`plait.data.walk`: hidden,
    ``__pycache__``, non-regular and binary files skipped), sorted by relative POSIX path;
    the built-in corpus also skips ``site-packages``, ``dist-packages`` and test folders."""
    skip = _SKIP_DIRS if root == stdlib_root() else SKIP_DIRS
    return walk(root, suffix, skip)[0]


def _join_texts(files: list[Path], max_bytes: int) -> bytes:
    """Concatenate the text files (non-text ones skipped) with SEPARATOR, cut at max_bytes."""
    parts: list[bytes] = []
    total = 0
    for path in files:
        if max_bytes and total >= max_bytes:
            break
        data = _read_text(path, max_bytes - total if max_bytes else 0)
        if not data:
            continue
        if parts:
            parts.append(SEPARATOR)
            total += len(SEPARATOR)
        parts.append(data)
        total += len(data)
    joined = b"".join(parts)
    return joined[:max_bytes] if max_bytes else joined


def read_corpus(cfg: DataConfig) -> bytes:
    """The text bytes of a text source (``"stdlib"``, a text file or a folder)."""
    if cfg.source == "stdlib":
        root = stdlib_root()
        data = _join_texts(sorted_files(root, ".py"), cfg.max_bytes)
        if not data:
            raise DataError(f"found no standard-library .py files under {root}.")
        return data
    path = Path(cfg.source).expanduser()
    if not path.exists():
        raise DataError(
            f"data.source {str(path)!r} does not exist; give 'stdlib', a text file, a folder "
            "of text files, or a pre-tokenized .npy/.bin file."
        )
    if not path.is_dir() and not path.is_file():
        raise DataError(
            f"data.source {str(path)!r} is neither a regular file nor a folder (a FIFO, "
            "socket or device would block or never end); give a file or a folder."
        )
    if path.is_dir():
        data = _join_texts(sorted_files(path, None), cfg.max_bytes)
        if not data:
            raise DataError(
                f"data.source folder {str(path)!r} holds no non-empty UTF-8 text files "
                "(hidden, binary and undecodable files are skipped)."
            )
        return data
    text = _read_text(path, cfg.max_bytes)
    if text is None:
        raise DataError(
            f"data.source {str(path)!r} is not UTF-8 text; give a text file, or a "
            "pre-tokenized file named *.npy or *.bin."
        )
    if not text:
        raise DataError(f"data.source {str(path)!r} is empty.")
    return text


def truncation_note(cfg: DataConfig) -> str | None:
    """A sentence saying that ``data.max_bytes`` cuts the user's text source, or None.

    Only a user's text file or folder is reported (the built-in ``stdlib`` corpus is cut
    on purpose, and pre-tokenized files are read whole); sizes come from the file system.
    """
    path = Path(cfg.source).expanduser()
    if cfg.source == "stdlib" or not cfg.max_bytes or path.suffix in (".npy", ".bin"):
        return None
    if is_prepared(path):  # token shards are read window by window, never cut
        return None
    if path.is_file():
        size = path.stat().st_size
    elif path.is_dir():
        size = sum(f.stat().st_size for f in sorted_files(path, None))
    else:
        return None
    if size <= cfg.max_bytes:
        return None
    return (
        f"data.source {str(path)!r} holds {size:,} bytes; only the first "
        f"{cfg.max_bytes:,} are used (data.max_bytes; set it to 0 to read everything)"
    )


def _load_pretokenized(path: Path, cfg: DataConfig) -> np.ndarray:
    """A memory-mapped 1-D token array from a .npy or raw .bin file."""
    if not path.is_file():
        raise DataError(f"data.source {str(path)!r} does not exist or is not a file.")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise DataError(f"cannot read {str(path)!r} as a .npy array: {exc}") from exc
        if arr.ndim != 1 or arr.dtype.kind not in "ui":
            raise DataError(
                f"{str(path)!r} holds a {arr.ndim}-D {arr.dtype} array; a pre-tokenized .npy "
                "must be a 1-D integer array (uint16 or uint32)."
            )
    else:
        dtype = np.dtype(cfg.token_dtype)
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise DataError(
                f"{str(path)!r} is {size} bytes, not a whole number of {cfg.token_dtype} "
                "tokens; check data.token_dtype."
            )
        if size == 0:
            raise DataError(f"data.source {str(path)!r} is empty.")
        arr = np.memmap(path, dtype=dtype, mode="r")
    if arr.size == 0:
        raise DataError(f"data.source {str(path)!r} is empty.")
    return arr


def load_tokens(cfg: DataConfig) -> np.ndarray:
    """The 1-D token array of ``cfg.source`` (unsigned ints; memory-mapped for .npy/.bin)."""
    path = Path(cfg.source).expanduser()
    if cfg.source != "stdlib" and path.suffix in (".npy", ".bin"):
        tokens = _load_pretokenized(path, cfg)
    else:
        tokens = make_tokenizer(cfg.tokenizer).encode(read_corpus(cfg))
    if tokens.size < 2:
        raise DataError(
            f"data.source {cfg.source!r} gives only {tokens.size} token(s); at least one "
            "sample of seq_len + 1 tokens is needed."
        )
    return tokens


def check_vocab(tokens: np.ndarray, vocab_size: int, name: str) -> None:
    """Raise DataError when a token id of ``tokens`` (the data of ``name``, a file or
    source) is outside ``[0, vocab_size)``, naming the id, where it is and the vocabulary."""
    if not tokens.size:
        return
    low, top = int(tokens.min()), int(tokens.max())
    if low < 0 or top >= vocab_size:
        bad = low if low < 0 else top
        where = int(np.argmax(tokens == bad))
        raise DataError(
            f"{name}: token id {bad} (at position {where:,}) is outside the vocabulary "
            f"[0, {vocab_size}) of model.vocab_size = {vocab_size}; raise model.vocab_size "
            "or use the tokenizer the data was made with."
        )


def split_train_val(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` views: the last ``val_fraction`` of the tokens is held out."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction}.")
    cut = len(tokens) - int(len(tokens) * val_fraction)
    return tokens[:cut], tokens[cut:]
