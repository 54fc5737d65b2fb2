"""``plait data prepare``: documents -> fixed-size token shards + an index, resumable.

The main process reads the documents in order (:mod:`plait.data.document_reader`) in batches
and hands them to ``workers`` processes that tokenize them (end-of-document token
appended to each); the results come back in submission order, so the shards do not
depend on the number of workers. The token stream is cut into shards of exactly
``shard_tokens`` tokens (the last shorter). Each shard is written to a temporary name
and renamed, then a small sidecar ``shard_NNNNN.json`` (tokens, SHA-256, the end offsets
of the documents that end in it) is written the same way; ``index.json`` comes last.

A re-run after an interruption keeps the shards whose sidecars verify (a contiguous
prefix), skips the documents they hold (without tokenizing them) and writes the rest; a
finished folder (``index.json`` present) is verified and left as it is.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from plait.config import TOKEN_DTYPES
from plait.data.document_reader import SourceFile, iter_documents, plan_source
from plait.data.index import (
    DOCUMENTS_NAME,
    INDEX_NAME,
    ShardIndex,
    dtype_holds,
    read_index,
    sha256_file,
    shard_name,
    token_dtype_for,
)
from plait.data.sample_folder import looks_like_chat, prepare_sample_folder, sample_line
from plait.data.sample_prepare import SampleOptions
from plait.data.tokenizers import AnyTokenizer, HFTokenizer, make_tokenizer
from plait.data.walk import skipped_note
from plait.data.writer import ShardWriter, kept_shards, sidecar_path, write_atomic
from plait.errors import ConfigError, DataError

PARAMS_NAME = "prepare.json"
"""What a folder is being prepared from (checked when a run resumes into it)."""

BATCH_DOCS = 256
"""Documents per task handed to a worker."""


@dataclass
class PrepareSummary:
    """What a prepare did."""

    out: Path
    documents: int
    tokens: int
    shards: int
    seconds: float
    workers: int
    resumed_shards: int = 0
    already_done: bool = False
    dtype: str = "uint16"
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of wall time (of this invocation)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """The final summary, one line."""
        if self.already_done:
            return (
                f"{self.out} is already prepared and verified: {self.documents:,} documents, "
                f"{self.tokens:,} tokens in {self.shards} shard(s); nothing rewritten"
            )
        resumed = (
            f" ({self.resumed_shards} kept from an earlier run)" if self.resumed_shards else ""
        )
        return (
            f"prepared {self.documents:,} documents, {self.tokens:,} tokens ({self.dtype}) in "
            f"{self.shards} shard(s){resumed} in {self.seconds:.1f} s: "
            f"{self.tokens_per_s:,.0f} tokens/s with {self.workers} worker(s) -> {self.out}"
        )


_TOKENIZER: AnyTokenizer | None = None


def _init_worker(spec: str) -> None:
    global _TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    _TOKENIZER = make_tokenizer(spec)


def encode_docs(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, lengths)``: the documents' ids each followed by eos (uint32), and each
    document's length with its eos (int64). Uses the worker's tokenizer."""
    tok = _TOKENIZER
    assert tok is not None and tok.eos_id is not None
    if isinstance(tok, HFTokenizer):
        parts = tok.encode_batch(texts)
    else:
        parts = [tok.encode(t).astype(np.uint32) for t in texts]
    eos = np.asarray([tok.eos_id], dtype=np.uint32)
    lengths = np.asarray([len(p) + 1 for p in parts], dtype=np.int64)
    flat = np.concatenate([x for p in parts for x in (p.astype(np.uint32), eos)])
    return flat, lengths


def _params(src: str, spec: str, fld: str, shard_tokens: int, dtype: str) -> dict[str, Any]:
    return {
        "source": str(Path(src).expanduser().resolve()),
        "tokenizer": spec,
        "field": fld,
        "shard_tokens": shard_tokens,
        "dtype": dtype,
    }


def _batches(docs: Iterator[str], skip_docs: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for n, d in enumerate(docs):
        if n < skip_docs:
            continue
        batch.append(d)
        if len(batch) == BATCH_DOCS:
            yield batch
            batch = []
    if batch:
        yield batch


def _check_tokenizer(tok: AnyTokenizer, dtype: str) -> None:
    where = getattr(tok, "path", tok.name)
    if tok.eos_id is None:
        raise DataError(
            f"{where}: the tokenizer has no end-of-document token (none of its "
            "tokenizer_config.json's eos_token, <|endoftext|>, </s>, <eos> ...)."
        )
    if not dtype_holds(dtype, tok.vocab_size):
        raise DataError(
            f"{where}: a vocabulary of {tok.vocab_size:,} tokens does not fit the token "
            f"dtype {dtype} (ids up to {2**16 - 1 if dtype == 'uint16' else 2**32 - 1}); "
            "use --dtype uint32."
        )


def prepare(
    src: str,
    out: str,
    tokenizer: str,
    *,
    workers: int = 1,
    fld: str = "text",
    shard_tokens: int = 1 << 26,
    dtype: str | None = None,
    progress: bool | None = None,
    samples: SampleOptions | None = None,
) -> PrepareSummary:
    """Prepare ``src`` into the folder ``out`` (see the module's docstring). ``samples``
    (or a chat JSONL source, told by its first record) prepares samples with a loss mask,
    packed or not (:mod:`plait.data.sample_prepare`)."""
    if workers < 1 or shard_tokens < 1:
        raise ConfigError("--workers and --shard-tokens must be positive.")
    tok = make_tokenizer(tokenizer)
    dtype = dtype or token_dtype_for(tok.vocab_size)
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(f"--dtype must be uint16 or uint32, got {dtype!r}.")
    _check_tokenizer(tok, dtype)
    root = Path(out).expanduser()
    if samples is None and looks_like_chat(src):
        samples = SampleOptions(chat=True)
    if samples is not None:
        return _samples(src, root, tok, fld, samples, shard_tokens, dtype)
    params = _params(src, tok.name, fld, shard_tokens, dtype)
    t0 = time.perf_counter()
    if (root / INDEX_NAME).is_file():
        return _verify_done(root, params, workers, t0)
    files, skipped = plan_source(src, fld)
    note = skipped_note(Path(src).expanduser(), skipped)
    if root.is_dir() and any(root.iterdir()) and not (root / PARAMS_NAME).is_file():
        raise ConfigError(
            f"{root} is not empty and holds no preparation to finish; give a new or empty "
            "folder as -o."
        )
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root} exists and is not a folder; give a new or empty folder as -o.")
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    try:
        summary = _prepare(root, files, tok, params, workers, fld, src, progress, t0)
    except DataError:
        if created and not any(root.glob("shard_*.bin")):  # nothing kept: leave no trace
            for p in root.iterdir():
                p.unlink()
            root.rmdir()
        raise
    if note:
        summary.notes.insert(0, note)
    return summary


def _samples(
    src: str,
    root: Path,
    tok: AnyTokenizer,
    fld: str,
    opts: SampleOptions,
    shard_tokens: int,
    dtype: str,
) -> PrepareSummary:
    idx, notes, done, seconds = prepare_sample_folder(
        src, root, tok, fld, opts, shard_tokens, dtype
    )
    summary = PrepareSummary(
        root,
        int((idx.samples or {}).get("samples", idx.documents)),
        idx.tokens,
        len(idx.shards),
        seconds,
        1,
        already_done=done,
        dtype=idx.dtype,
        notes=[*notes, sample_line(idx)],
    )
    return summary


def _prepare(
    root: Path,
    files: list[SourceFile],
    tok: AnyTokenizer,
    params: dict[str, Any],
    workers: int,
    fld: str,
    src: str,
    progress: bool | None,
    t0: float,
) -> PrepareSummary:
    shard_tokens, dtype = int(params["shard_tokens"]), str(params["dtype"])
    side = root / PARAMS_NAME
    if side.is_file():
        old = json.loads(side.read_text(encoding="utf-8"))
        if old != params:
            raise ConfigError(
                f"{root} holds an unfinished preparation of other inputs ({old}); remove the "
                "folder or choose another -o."
            )
    else:
        write_atomic(side, json.dumps(params).encode())
    item = np.dtype(dtype).itemsize
    kept = kept_shards(root, shard_tokens, item)
    at = len(kept) * shard_tokens
    done_ends = [e for m in kept for e in m["doc_ends"]]
    skip_docs = len(done_ends)
    skip_tokens = at - (done_ends[-1] if done_ends else 0)
    writer = ShardWriter(root, shard_tokens, dtype, len(kept), at)
    from tqdm import tqdm

    bar = tqdm(
        desc="tokenizing",
        unit=" docs",
        disable=(not sys.stderr.isatty()) if progress is None else not progress,
    )
    bar.update(skip_docs)
    tokens_here = 0
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    pool = ctx.Pool(workers, _init_worker, (tok.name,)) if workers > 1 else None
    if pool is None:
        _init_worker(tok.name)
    try:
        pending: deque[Any] = deque()
        batches = _batches(iter_documents(files, fld), skip_docs)

        def take() -> None:
            nonlocal skip_tokens, tokens_here
            res = pending.popleft()
            tokens, lengths = res.get() if pool is not None else res
            writer.add(tokens, lengths, skip_tokens)
            tokens_here += len(tokens) - skip_tokens
            skip_tokens = 0
            bar.update(len(lengths))

        for batch in batches:
            pending.append(pool.apply_async(encode_docs, (batch,)) if pool else encode_docs(batch))
            while len(pending) > 2 * workers:
                take()
        while pending:
            take()
        writer.flush()
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    return _finish(root, tok, params, writer, src, fld, kept, tokens_here, workers, t0)


def _finish(
    root: Path,
    tok: AnyTokenizer,
    params: dict[str, Any],
    writer: ShardWriter,
    src: str,
    fld: str,
    kept: list[dict[str, Any]],
    tokens_here: int,
    workers: int,
    t0: float,
) -> PrepareSummary:
    metas = [
        json.loads(sidecar_path(root, i).read_text(encoding="utf-8")) for i in range(writer.index)
    ]
    ends = np.asarray([e for m in metas for e in m["doc_ends"]], dtype=np.uint64)
    total = sum(int(m["tokens"]) for m in metas)
    if len(ends) == 0 or total == len(ends):
        raise DataError(f"{src} holds no text: {len(ends)} document(s), all empty.")
    write_atomic(root / DOCUMENTS_NAME, ends.tobytes())
    index = ShardIndex(
        root=root,
        tokenizer=tok.name,
        vocab_size=tok.vocab_size,
        eos_id=int(tok.eos_id or 0),
        dtype=params["dtype"],
        shard_tokens=params["shard_tokens"],
        documents=len(ends),
        tokens=total,
        shards=[
            {"file": shard_name(i), "tokens": int(m["tokens"]), "sha256": m["sha256"]}
            for i, m in enumerate(metas)
        ],
        document_ends={"file": DOCUMENTS_NAME, "sha256": sha256_file(root / DOCUMENTS_NAME)},
        source={"path": params["source"], "field": fld},
    )
    index.write()
    for i in range(writer.index):
        sidecar_path(root, i).unlink(missing_ok=True)
    (root / PARAMS_NAME).unlink(missing_ok=True)
    return PrepareSummary(
        root,
        len(ends),
        total,
        len(metas),
        time.perf_counter() - t0,
        workers,
        resumed_shards=len(kept),
        dtype=params["dtype"],
    )


def _verify_done(root: Path, params: dict[str, Any], workers: int, t0: float) -> PrepareSummary:
    idx = read_index(root)
    asked = {
        "tokenizer": params["tokenizer"],
        "shard_tokens": params["shard_tokens"],
        "dtype": params["dtype"],
        "source": params["source"],
    }
    has = {
        "tokenizer": idx.tokenizer,
        "shard_tokens": idx.shard_tokens,
        "dtype": idx.dtype,
        "source": idx.source.get("path"),
    }
    if asked != has:
        diff = ", ".join(
            f"{k} {has[k]!r} (asked {asked[k]!r})" for k in asked if asked[k] != has[k]
        )
        raise ConfigError(f"{root} is already prepared from other inputs: {diff}.")
    bad = idx.problems()
    if bad:
        raise DataError(
            f"{root} is prepared but damaged: {'; '.join(bad)}; remove the folder and prepare "
            "it again."
        )
    return PrepareSummary(
        root,
        idx.documents,
        idx.tokens,
        len(idx.shards),
        time.perf_counter() - t0,
        workers,
        already_done=True,
        dtype=idx.dtype,
    )
