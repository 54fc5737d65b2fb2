"""``plait data prepare`` of samples: chat or instruction data with a loss mask, and
packing (``--pack SEQ_LEN``) of any samples into whole windows.

Each sample becomes ``(ids, mask)``: a conversation rendered by the tokenizer's chat template
(:mod:`plait.data.chat_template`; ``mask`` from ``--train-on``) and the template's free
separator token, or a text document's ids and its end-of-document token (every token
trained but the first). Every sample ends with that id (the folder's ``eos_id``), which
no sample holds elsewhere, so the document ids ``data.mask_documents`` derives from it
(:mod:`plait.model.document_mask`) are the samples. A sample with no trained token (no
assistant turn), or one whose text holds the end id itself, is dropped and counted.

Unpacked, the samples are written one after another, as plain documents are. Packed,
they go through :class:`~plait.data.packing.Packer` into windows of ``seq_len + 1``
tokens (inputs are a window's first ``seq_len``, targets its last ``seq_len``), each
window's free tail padded with the end-of-document token (mask 0). A sample longer than
a window is cut to it, its last token the end id again (``--long-samples truncate``), or
refused (``refuse``). The
documents (``documents.bin``) are then the samples and the padding runs, so the document
ids of any window come from the memory-mapped end offsets.

The mask is written beside the tokens (``mask_NNNNN.bin``, one byte a token, the same
shard sizes); :mod:`plait.data.shards` and :mod:`plait.data.packed` turn every target
whose mask is 0 into the loss's ignore index. One process; an interrupted run starts
over (it is not resumed shard by shard as plain text is).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from plait.data.array_shards import ArrayShards
from plait.data.chat_records import iter_conversations
from plait.data.chat_template import TRAIN_ON, ChatTemplate
from plait.data.document_reader import SourceFile, iter_documents
from plait.data.index import DOCUMENTS_NAME, ShardIndex, sha256_file
from plait.data.packing import ALGORITHM, DEFAULT_BUFFER, Packer
from plait.data.tokenizers import AnyTokenizer
from plait.data.writer import write_atomic
from plait.errors import ConfigError, DataError

LONG_SAMPLES = ("truncate", "refuse")
"""``--long-samples`` choices."""

Sample = tuple[np.ndarray, np.ndarray]
"""``(ids, mask)``: ``(n,)`` token ids and ``(n,)`` uint8 trained-target flags."""


@dataclass
class SampleOptions:
    """How samples are made and laid out."""

    chat: bool
    """Chat/instruction JSONL (True) or text documents (False)."""
    train_on: str = "assistant"
    """Which tokens are trained: all, assistant or last (the last assistant turn)."""
    chat_template: str | None = None
    """A template file used instead of the tokenizer folder's."""
    pack: int | None = None
    """Pack into windows of ``pack + 1`` tokens (None: unpacked)."""
    long_samples: str = "truncate"
    """A sample longer than a window: cut to it, or refuse the data."""
    buffer: int = DEFAULT_BUFFER
    """Samples packed together."""

    def __post_init__(self) -> None:
        if self.train_on not in TRAIN_ON:
            raise ConfigError(f"--train-on must be one of {TRAIN_ON}, got {self.train_on!r}.")
        if self.long_samples not in LONG_SAMPLES:
            raise ConfigError(f"--long-samples must be one of {LONG_SAMPLES}.")
        if self.pack is not None and self.pack < 1:
            raise ConfigError(f"--pack must be a positive sequence length, got {self.pack}.")
        if self.buffer < 1:
            raise ConfigError(f"--pack-buffer must be positive, got {self.buffer}.")


@dataclass
class SampleStats:
    """Counts of one preparation."""

    samples: int = 0
    dropped: int = 0
    holding_end: int = 0
    truncated: int = 0
    trained_tokens: int = 0
    real_tokens: int = 0
    windows: int = 0
    ends: list[int] = field(default_factory=list)
    """End offsets of the documents (samples, and padding runs when packed)."""
    shards: list[dict[str, Any]] = field(default_factory=list)
    """Index entries of the token shards."""
    masks: list[dict[str, Any]] = field(default_factory=list)
    """Index entries of the mask shards."""


def make_samples(
    files: list[SourceFile], tok: AnyTokenizer, fld: str, opts: SampleOptions, spec: str
) -> tuple[int, Iterator[Sample]]:
    """``(end_id, samples)``: every sample of ``files`` as ``(ids, mask)``, each ending with
    ``end_id`` (mask 0), which no sample holds elsewhere: the tokenizer's eos for text, the
    chat template's free separator for chat (see the module's docstring)."""
    if opts.chat:
        template = ChatTemplate(spec, opts.chat_template)
        sep = template.separator()

        def chats() -> Iterator[Sample]:
            end, zero = np.asarray([sep], dtype=np.uint32), np.zeros(1, dtype=np.uint8)
            for messages in iter_conversations([f.path for f in files]):
                ids, mask = template.encode(messages, opts.train_on)
                yield np.concatenate([ids, end]), np.concatenate([mask, zero])

        return sep, chats()
    assert tok.eos_id is not None
    eos = np.asarray([tok.eos_id], dtype=np.uint32)

    def texts() -> Iterator[Sample]:
        for text in iter_documents(files, fld):
            ids = np.concatenate([tok.encode(text).astype(np.uint32), eos])
            mask = np.ones(len(ids), dtype=np.uint8)
            mask[0] = 0
            yield ids, mask

    return int(tok.eos_id), texts()


class _Out:
    """The token and mask shards and the document ends being written."""

    def __init__(self, root: Path, shard_tokens: int, dtype: str, stats: SampleStats) -> None:
        self.tokens = ArrayShards(root, "shard", shard_tokens, dtype)
        self.masks = ArrayShards(root, "mask", shard_tokens, "uint8")
        self.stats = stats
        self.at = 0

    def document(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self.tokens.add(ids)
        self.masks.add(mask)
        self.at += len(ids)
        self.stats.ends.append(self.at)

    def window(self, samples: list[Sample], capacity: int, pad: int) -> None:
        for ids, mask in samples:
            self.document(ids, mask)
        free = capacity - sum(len(ids) for ids, _ in samples)
        if free:
            self.document(np.full(free, pad, dtype=np.uint32), np.zeros(free, dtype=np.uint8))
        self.stats.windows += 1


def write_samples(
    root: Path,
    samples: Iterator[Sample],
    end_id: int,
    opts: SampleOptions,
    shard_tokens: int,
    dtype: str,
) -> SampleStats:
    """Write the samples' shards, masks and ``documents.bin`` under ``root``; returns the
    counts and the shard entries."""
    stats = SampleStats()
    out = _Out(root, shard_tokens, dtype, stats)
    capacity = None if opts.pack is None else opts.pack + 1
    packer = None if capacity is None else Packer(capacity, opts.buffer)
    pad = end_id  # padding: each token its own document, as the end id makes it
    for n, (ids, mask) in enumerate(samples):
        if not mask.any():
            stats.dropped += 1
            continue
        if (ids[:-1] == end_id).any():  # its text writes the separator: the ids would break
            stats.holding_end += 1
            continue
        if capacity is not None and len(ids) > capacity:
            if opts.long_samples == "refuse":
                raise DataError(
                    f"sample {n} has {len(ids)} tokens, more than a packed window of "
                    f"{capacity} (--pack {opts.pack} + 1); raise --pack, or cut long samples "
                    "with --long-samples truncate."
                )
            end = np.asarray([end_id], dtype=ids.dtype)  # a cut sample still ends with it
            ids = np.concatenate([ids[: capacity - 1], end])
            mask = np.concatenate([mask[: capacity - 1], np.zeros(1, dtype=np.uint8)])
            stats.truncated += 1
            if not mask.any():
                stats.dropped += 1
                continue
        stats.samples += 1
        stats.trained_tokens += int(mask.sum())
        stats.real_tokens += len(ids)
        if packer is None:
            out.document(ids, mask)
            continue
        assert capacity is not None
        for window in packer.add(ids, mask):
            out.window(window, capacity, pad)
    if packer is not None and capacity is not None:
        for window in packer.flush():
            out.window(window, capacity, pad)
    if stats.samples == 0:
        raise DataError(
            "no sample to train on: every sample was empty or had no trained token "
            f"(--train-on {opts.train_on}: no assistant turn)."
        )
    write_atomic(root / DOCUMENTS_NAME, np.asarray(stats.ends, dtype=np.uint64).tobytes())
    stats.shards, stats.masks = out.tokens.close(), out.masks.close()
    return stats


def prepare_samples(
    root: Path,
    files: list[SourceFile],
    tok: AnyTokenizer,
    fld: str,
    opts: SampleOptions,
    shard_tokens: int,
    dtype: str,
    source: str,
) -> tuple[ShardIndex, SampleStats]:
    """Prepare ``files`` into the empty folder ``root``: shards, masks, documents, index."""
    if opts.pack is not None:  # whole windows per shard: a window is read from one file
        window = opts.pack + 1
        shard_tokens = max(window, shard_tokens // window * window)
    t0 = time.perf_counter()
    end_id, samples = make_samples(files, tok, fld, opts, tok.name)
    stats = write_samples(root, samples, end_id, opts, shard_tokens, dtype)
    info: dict[str, Any] = {
        "kind": "chat" if opts.chat else "text",
        "train_on": opts.train_on if opts.chat else "all",
        "samples": stats.samples,
        "trained_tokens": stats.trained_tokens,
        "dropped": stats.dropped,
        "holding_end": stats.holding_end,
        "truncated": stats.truncated,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if opts.chat:
        info["template"] = opts.chat_template or "tokenizer"
    packed = None
    if opts.pack is not None:
        packed = {
            "seq_len": opts.pack,
            "window": opts.pack + 1,
            "windows": stats.windows,
            "real_tokens": stats.real_tokens,
            "algorithm": ALGORITHM,
            "buffer": opts.buffer,
        }
    index = ShardIndex(
        root=root,
        tokenizer=tok.name,
        vocab_size=tok.vocab_size,
        eos_id=end_id,
        dtype=dtype,
        shard_tokens=shard_tokens,
        documents=len(stats.ends),
        tokens=sum(int(e["tokens"]) for e in stats.shards),
        shards=stats.shards,
        document_ends={"file": DOCUMENTS_NAME, "sha256": sha256_file(root / DOCUMENTS_NAME)},
        source={"path": source, "field": "messages" if opts.chat else fld},
        masks=stats.masks,
        samples=info,
        packed=packed,
    )
    index.write()
    return index, stats
