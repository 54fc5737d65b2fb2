"""Data: tokenizers, corpus sources, prepared token shards, mixtures, samplers, loader.

======================  ==========================================================
module                  what it owns
======================  ==========================================================
``tokenizers``          ``byte``, ``tiktoken:NAME``, ``hf:PATH``; vocab size, eos id
``corpus``              sources read whole: built-in corpus, text, ``.npy``/``.bin``
``dataset``             fixed-length windows of an in-memory token array
``document_reader``     the documents of a prepare source (text, JSONL, parquet, datasets)
``index``               the prepared folder's ``index.json``
``prepare``             ``plait data prepare``: parallel, resumable, verified
``writer``              shard files, their sidecars, the finished prefix on resume
``shards``              windows over memory-mapped shards; held-out documents
``walk``                the one folder rule of prepare and train (hidden, binary skipped)
``chat_records``        chat / prompt-completion JSONL records, checked (file:line)
``chat_template``       a tokenizer's chat template as transformers renders it; masks
``packing``             first-fit decreasing over a bounded buffer
``sample_prepare``      samples with a loss mask, packed or not, into shards
``sample_folder``       chat told from text; a finished sample folder verified
``array_shards``        fixed-size shard files of one stream (tokens or mask)
``packed``              the windows of a packed folder and their document ids
``blending``            a mixture's blend, evaluated per window (chunked merge)
``mixture``             weighted blends of sources (Megatron's blended datasets)
``sources``             a run's ``(train, val)`` window sets from its ``DataConfig``
``order``               each epoch's permutation, per position (Feistel; legacy randperm)
``sampler``             the stateless batch order, a pure function of ``(seed, step)``
``parts``               the halves of a batch a rank reads (pipeline stages)
``read_count``          bytes this process read from its data
``loader``              the background loader thread (pinned memory on CUDA)
======================  ==========================================================

The names below are imported on first use (``plait data`` runs without importing torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.data.corpus import (
        SEPARATOR,
        check_vocab,
        load_tokens,
        read_corpus,
        split_train_val,
        stdlib_root,
        truncation_note,
    )
    from plait.data.dataset import TokenDataset, WindowSet, check_enough
    from plait.data.index import ShardIndex, is_prepared, read_index
    from plait.data.loader import BackgroundLoader
    from plait.data.mixture import MixtureDataset, blend, parse_mixture
    from plait.data.sampler import BatchSampler
    from plait.data.shards import SegmentDataset, ShardStream, open_prepared
    from plait.data.sources import (
        data_eos_id,
        data_tokenizer,
        eval_windows,
        make_datasets,
        source_kind,
    )
    from plait.data.tokenizers import (
        ByteTokenizer,
        HFTokenizer,
        TiktokenTokenizer,
        Tokenizer,
        check_covers_vocab,
        make_tokenizer,
    )

_WHERE: dict[str, str] = {
    "BackgroundLoader": "plait.data.loader",
    "BatchSampler": "plait.data.sampler",
    "ByteTokenizer": "plait.data.tokenizers",
    "HFTokenizer": "plait.data.tokenizers",
    "MixtureDataset": "plait.data.mixture",
    "SEPARATOR": "plait.data.corpus",
    "SegmentDataset": "plait.data.shards",
    "ShardIndex": "plait.data.index",
    "ShardStream": "plait.data.shards",
    "TiktokenTokenizer": "plait.data.tokenizers",
    "TokenDataset": "plait.data.dataset",
    "Tokenizer": "plait.data.tokenizers",
    "WindowSet": "plait.data.dataset",
    "blend": "plait.data.mixture",
    "check_covers_vocab": "plait.data.tokenizers",
    "check_enough": "plait.data.dataset",
    "check_vocab": "plait.data.corpus",
    "data_eos_id": "plait.data.sources",
    "data_tokenizer": "plait.data.sources",
    "eval_windows": "plait.data.sources",
    "is_prepared": "plait.data.index",
    "load_tokens": "plait.data.corpus",
    "make_datasets": "plait.data.sources",
    "make_tokenizer": "plait.data.tokenizers",
    "open_prepared": "plait.data.shards",
    "parse_mixture": "plait.data.mixture",
    "read_corpus": "plait.data.corpus",
    "read_index": "plait.data.index",
    "source_kind": "plait.data.sources",
    "split_train_val": "plait.data.corpus",
    "stdlib_root": "plait.data.corpus",
    "truncation_note": "plait.data.corpus",
}
"""Public name -> the module that defines it."""

__all__ = [
    "SEPARATOR",
    "BackgroundLoader",
    "BatchSampler",
    "ByteTokenizer",
    "HFTokenizer",
    "MixtureDataset",
    "SegmentDataset",
    "ShardIndex",
    "ShardStream",
    "TiktokenTokenizer",
    "TokenDataset",
    "Tokenizer",
    "WindowSet",
    "blend",
    "check_covers_vocab",
    "check_enough",
    "check_vocab",
    "data_eos_id",
    "data_tokenizer",
    "eval_windows",
    "is_prepared",
    "load_tokens",
    "make_datasets",
    "make_tokenizer",
    "open_prepared",
    "parse_mixture",
    "read_corpus",
    "read_index",
    "source_kind",
    "split_train_val",
    "stdlib_root",
    "truncation_note",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'plait.data' has no attribute {name!r}")
    return getattr(importlib.import_module(where), name)
