"""The training and validation window sets of a run's ``DataConfig``, whatever the source.

* a prepared folder (``plait data prepare``; told by its ``index.json``): memory-mapped
  shards, validation from the held-out documents (``data.val_fraction`` of them, by a hash
  of the document number) or from the prepared folder ``data.val``;
* a mixture ``"DIR_A:0.7,DIR_B:0.3"`` of prepared folders: training windows blended by
  weight (:mod:`plait.data.mixture`); validation likewise from their held-out documents
  (or ``data.val``);
* anything else (the built-in corpus, text, ``.npy``/``.bin``): read whole
  (:mod:`plait.data.corpus`), the last ``data.val_fraction`` of the tokens held out.

The model's vocabulary must cover the data's (the prepared index's tokenizer, or the
tokenizer of a text source): refused before any work otherwise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from plait.config import DataConfig
from plait.data.corpus import check_vocab, load_tokens, split_train_val
from plait.data.dataset import TokenDataset, WindowSet
from plait.data.index import ShardIndex, is_prepared, read_index
from plait.data.mixture import MixtureDataset, parse_mixture
from plait.data.shards import open_prepared
from plait.data.tokenizers import check_covers_vocab, make_tokenizer
from plait.errors import DataError


def _prepared(path: str, what: str, vocab_size: int) -> None:
    """Refuse ``path`` unless it is a prepared folder whose vocabulary the model covers."""
    if not is_prepared(path):
        raise DataError(
            f"{what} {path!r} is not a prepared folder (no index.json); make one with "
            "`plait data prepare SRC -o DIR --tokenizer SPEC`."
        )
    idx = read_index(path)
    check_covers_vocab(idx.vocab_size, vocab_size, f"{path} (tokenizer {idx.tokenizer})")


def _same_path(a: str, b: str) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def _same_tokenizer(a: str, b: str) -> bool:
    """Whether two tokenizer specs name the same tokenizer (``hf:`` paths resolved)."""
    if a.startswith("hf:") and b.startswith("hf:"):
        return _same_path(a[3:], b[3:])
    return a == b


def data_index(cfg: DataConfig) -> ShardIndex | None:
    """The index of the prepared data of ``cfg`` (a prepared folder, or a mixture's first
    entry), ``None`` for a source read whole. Every mixture entry and ``data.val`` must have
    been prepared with the same tokenizer (and end-of-document id): DataError otherwise."""
    kind = source_kind(cfg)
    if kind == "tokens":
        return None
    paths = [p for p, _ in parse_mixture(cfg.source) or []] if kind == "mixture" else [cfg.source]
    if cfg.val is not None:
        paths.append(cfg.val)
    first: ShardIndex | None = None
    for path in paths:
        if not is_prepared(path):
            continue  # refused with its own message by make_datasets
        idx = read_index(path)
        if first is None:
            first = idx
        elif not _same_tokenizer(idx.tokenizer, first.tokenizer) or idx.eos_id != first.eos_id:
            raise DataError(
                f"{first.root} was prepared with tokenizer {first.tokenizer!r} (eos id "
                f"{first.eos_id}) but {idx.root} with {idx.tokenizer!r} (eos id {idx.eos_id}); "
                "the sources of one run (mixture entries and data.val) must share a tokenizer."
            )
    return first


def data_tokenizer(cfg: DataConfig) -> str:
    """The tokenizer spec the run's tokens are in: the prepared index's for a prepared
    folder or mixture (``data.tokenizer`` may be left at ``'byte'`` or name the same one;
    another is refused with DataError), else ``data.tokenizer``."""
    idx = data_index(cfg)
    if idx is None:
        return cfg.tokenizer
    if cfg.tokenizer != "byte" and not _same_tokenizer(cfg.tokenizer, idx.tokenizer):
        raise DataError(
            f"data.tokenizer {cfg.tokenizer!r} differs from the tokenizer {idx.root} was "
            f"prepared with, {idx.tokenizer!r}; leave data.tokenizer unset or set it to that."
        )
    return idx.tokenizer


def data_eos_id(cfg: DataConfig) -> int | None:
    """The end-of-document id recorded by the prepared data of ``cfg``; ``None`` for a
    source read whole (then the tokenizer's own applies)."""
    data_tokenizer(cfg)  # refuses a contradicting data.tokenizer
    idx = data_index(cfg)
    return None if idx is None else idx.eos_id


def source_kind(cfg: DataConfig) -> str:
    """``"mixture"``, ``"prepared"`` or ``"tokens"`` (read whole)."""
    if parse_mixture(cfg.source) is not None:
        return "mixture"
    if cfg.source != "stdlib" and is_prepared(cfg.source):
        return "prepared"
    return "tokens"


def _tokens(cfg: DataConfig, vocab_size: int) -> np.ndarray:
    """The tokens of a source read whole (memory-mapped for ``.npy``/``.bin``), refused
    when the model's vocabulary does not cover them."""
    if cfg.tokenizer != "byte" and Path(cfg.source).suffix not in (".npy", ".bin"):
        tok = make_tokenizer(cfg.tokenizer)
        check_covers_vocab(tok.vocab_size, vocab_size, f"data.tokenizer {tok.name}")
    tokens = load_tokens(cfg)
    check_vocab(tokens, vocab_size, cfg.source)
    return tokens


def eval_windows(cfg: DataConfig, seq_len: int, vocab_size: int) -> WindowSet:
    """Every window of ``cfg.source`` in order, nothing held out (``plait eval``): a
    prepared folder memory-mapped (its stream cut into windows, or a packed folder's
    windows; chat masks applied), a ``.npy``/``.bin`` memory-mapped, text tokenized whole.
    A rank reads only the windows it evaluates. A mixture is refused."""
    kind = source_kind(cfg)
    if kind == "mixture":
        raise DataError(
            f"plait eval reads one source, not the mixture {cfg.source!r}; evaluate each "
            "prepared folder on its own."
        )
    if kind == "prepared":
        _prepared(cfg.source, "data.source", vocab_size)
        data_tokenizer(cfg)  # data.tokenizer, if named, is the folder's
        return open_prepared(cfg.source, seq_len, None)[0]
    return TokenDataset(_tokens(cfg, vocab_size), seq_len)


def make_datasets(cfg: DataConfig, seq_len: int, vocab_size: int) -> tuple[WindowSet, WindowSet]:
    """``(train, val)`` window sets of ``cfg`` for windows of ``seq_len + 1`` tokens."""
    kind = source_kind(cfg)
    if cfg.val is not None:
        _prepared(cfg.val, "data.val", vocab_size)
    val: WindowSet | None = None
    if cfg.val is not None:
        val = open_prepared(cfg.val, seq_len, None)[0]
    if kind == "tokens":
        if cfg.val is not None:
            raise DataError(
                "data.val is for a prepared folder or mixture as data.source; with "
                f"{cfg.source!r} the last data.val_fraction of the tokens is held out."
            )
        train_tokens, val_tokens = split_train_val(_tokens(cfg, vocab_size), cfg.val_fraction)
        return TokenDataset(train_tokens, seq_len), TokenDataset(val_tokens, seq_len)
    data_tokenizer(cfg)  # one tokenizer across the sources, and data.tokenizer agrees
    if cfg.val is not None:
        entries = (
            [cfg.source] if kind == "prepared" else [p for p, _ in parse_mixture(cfg.source) or []]
        )
        for path in entries:
            if _same_path(path, cfg.val):
                raise DataError(
                    f"data.val {cfg.val!r} is also a training source; validate on a prepared "
                    "folder that is not trained on (or leave data.val unset to hold out "
                    "data.val_fraction of the documents)."
                )
    frac = None if cfg.val is not None else cfg.val_fraction
    if kind == "prepared":
        _prepared(cfg.source, "data.source", vocab_size)
        train, held = open_prepared(cfg.source, seq_len, frac)
        return train, val if val is not None else held  # type: ignore[return-value]
    mix = parse_mixture(cfg.source) or []
    trains, helds = [], []
    for path, _ in mix:
        _prepared(path, "data.source mixture entry", vocab_size)
        t, h = open_prepared(path, seq_len, frac)
        trains.append(t)
        helds.append(h)
    weights = [w for _, w in mix]
    train_mix = MixtureDataset(trains, weights)
    if val is None:
        val = MixtureDataset([h for h in helds if h is not None], weights)
    return train_mix, val
