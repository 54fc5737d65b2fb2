"""Kept for callers of the earlier module: the data code lives in :mod:`plait.data`
(tokenizers, corpus, prepared shards, mixtures, sampler, loader); these are its names."""

from plait.data import (
    SEPARATOR,
    BatchSampler,
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    TokenDataset,
    Tokenizer,
    check_enough,
    check_vocab,
    load_tokens,
    make_datasets,
    make_tokenizer,
    read_corpus,
    split_train_val,
    stdlib_root,
    truncation_note,
)

__all__ = [
    "SEPARATOR",
    "BatchSampler",
    "ByteTokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "TokenDataset",
    "Tokenizer",
    "check_enough",
    "check_vocab",
    "load_tokens",
    "make_datasets",
    "make_tokenizer",
    "read_corpus",
    "split_train_val",
    "stdlib_root",
    "truncation_note",
]
