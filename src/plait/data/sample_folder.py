"""The folder side of preparing samples (:mod:`plait.data.sample_prepare`): telling chat
data from text, a finished folder verified and kept, an unfinished one started over, and
the summary ``plait data prepare`` prints."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from plait.data.chat_records import first_record, is_chat_record
from plait.data.document_reader import JSONL, plan_source
from plait.data.index import INDEX_NAME, read_index
from plait.data.sample_prepare import SampleOptions, prepare_samples
from plait.data.tokenizers import AnyTokenizer
from plait.data.walk import skipped_note, walk
from plait.data.writer import write_atomic
from plait.errors import ConfigError, DataError

PARAMS_NAME = "prepare.json"
"""What an unfinished folder is being prepared from (as :mod:`plait.data.prepare`)."""


def looks_like_chat(src: str) -> bool:
    """Whether the first JSONL file of ``src`` starts with a chat or prompt/completion record."""
    root = Path(src).expanduser()
    files = [root] if root.is_file() else walk(root)[0] if root.is_dir() else []
    for f in files:
        if f.name.lower().endswith(JSONL):
            return is_chat_record(first_record(f))
    return False


def _params(src: str, tok: AnyTokenizer, opts: SampleOptions, dtype: str) -> dict[str, Any]:
    return {
        "source": str(Path(src).expanduser().resolve()),
        "tokenizer": tok.name,
        "dtype": dtype,
        "chat": opts.chat,
        "train_on": opts.train_on,
        "chat_template": opts.chat_template,
        "pack": opts.pack,
        "long_samples": opts.long_samples,
        "buffer": opts.buffer,
    }


def _verify(root: Path, params: dict[str, Any]) -> tuple[Any, bool]:
    idx = read_index(root)
    old = (
        json.loads((root / PARAMS_NAME).read_text(encoding="utf-8"))
        if (root / PARAMS_NAME).is_file()
        else (idx.samples or {}).get("params")
    )
    if old != params:
        raise ConfigError(f"{root} is already prepared from other inputs or options ({old}).")
    bad = idx.problems()
    if bad:
        raise DataError(
            f"{root} is prepared but damaged: {'; '.join(bad)}; remove the folder and prepare "
            "it again."
        )
    return idx, True


def prepare_sample_folder(
    src: str,
    root: Path,
    tok: AnyTokenizer,
    fld: str,
    opts: SampleOptions,
    shard_tokens: int,
    dtype: str,
) -> tuple[Any, list[str], bool, float]:
    """``(index, notes, already_done, seconds)`` of preparing ``src`` into ``root``."""
    t0 = time.perf_counter()
    params = _params(src, tok, opts, dtype)
    if (root / INDEX_NAME).is_file():
        idx, _ = _verify(root, params)
        return idx, [], True, time.perf_counter() - t0
    files, skipped = plan_source(src, None if opts.chat else fld)
    if opts.chat and any(f.kind != "jsonl" for f in files):
        bad = next(f.path for f in files if f.kind != "jsonl")
        raise DataError(f"{bad}: chat data is read from .jsonl files only.")
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root} exists and is not a folder; give a new or empty folder as -o.")
    if root.is_dir() and any(root.iterdir()):
        if not (root / PARAMS_NAME).is_file():
            raise ConfigError(
                f"{root} is not empty and holds no preparation to finish; give a new or empty "
                "folder as -o."
            )
        shutil.rmtree(root)  # an unfinished sample preparation starts over
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(root / PARAMS_NAME, json.dumps(params).encode())
    try:
        idx, _ = prepare_samples(root, files, tok, fld, opts, shard_tokens, dtype, params["source"])
    except DataError:
        shutil.rmtree(root, ignore_errors=True)
        raise
    samples = dict(idx.samples or {})
    samples["params"] = params
    idx = type(idx)(**{**idx.__dict__, "samples": samples})
    idx.write()
    (root / PARAMS_NAME).unlink()
    note = skipped_note(Path(src).expanduser(), skipped)
    return idx, [note] if note else [], False, time.perf_counter() - t0


def sample_line(idx: Any) -> str:
    """One line on what a sample preparation holds (``plait data info`` and prepare)."""
    s = idx.samples or {}
    parts = [
        f"{s.get('samples', 0):,} {s.get('kind', 'text')} samples, "
        f"{s.get('trained_tokens', 0):,} trained tokens (--train-on {s.get('train_on', 'all')})"
    ]
    if s.get("dropped"):
        parts.append(f"{s['dropped']:,} dropped (no trained token)")
    if s.get("holding_end"):
        parts.append(f"{s['holding_end']:,} dropped (the text holds the end-of-sample token)")
    if s.get("truncated"):
        parts.append(f"{s['truncated']:,} cut to the window")
    if idx.packed is not None:
        p = idx.packed
        parts.append(
            f"packed into {p['windows']:,} windows of {p['seq_len']} + 1 tokens, "
            f"{idx.packing_efficiency:.1%} real tokens ({p['algorithm']}, {p['buffer']} samples)"
        )
    return "; ".join(parts)
