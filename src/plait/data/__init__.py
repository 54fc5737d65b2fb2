"""Data: tokenizers, corpus sources, prepared token shards, mixtures, samplers, loader.

==================  ==========================================================
module              what it owns
==================  ==========================================================
``tokenizers``      ``byte``, ``tiktoken:NAME``, ``hf:PATH``; vocab size, eos id
``corpus``          sources read whole: built-in corpus, text, ``.npy``/``.bin``
``dataset``         fixed-length windows of an in-memory token array
``documents``       the documents of a prepare source (text, JSONL, parquet, datasets)
``index``           the prepared folder's ``index.json``
``prepare``         ``plait data prepare``: parallel, resumable, verified
``shards``          windows over memory-mapped shards; held-out documents
``mixture``         weighted blends of sources (Megatron's blended datasets)
``sources``         a run's ``(train, val)`` window sets from its ``DataConfig``
``sampler``         the stateless batch order, a pure function of ``(seed, step)``
``loader``          the background loader thread (pinned memory on CUDA)
==================  ==========================================================
"""

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
from plait.data.sources import make_datasets, source_kind
from plait.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    check_covers_vocab,
    make_tokenizer,
)

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
