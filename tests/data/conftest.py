"""Fixtures of the data tests: a BPE tokenizer trained here on the built-in corpus (no
download), and small sources (a folder of text, a JSONL file) to prepare."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.config import DataConfig
from plait.data import read_corpus

EOS = "<|endoftext|>"


@pytest.fixture(scope="session")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``tokenizer.json``: byte-level BPE of 400 tokens trained on 300 kB of the
    built-in corpus, with ``<|endoftext|>`` (a second or so)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = read_corpus(DataConfig(max_bytes=300_000)).decode("utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.split("\n\n"), trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


def documents(n: int = 60) -> list[str]:
    """``n`` varied documents (some unicode, one empty) cut from the built-in corpus."""
    text = read_corpus(DataConfig(max_bytes=120_000)).decode("utf-8")
    step = len(text) // n
    docs = [text[i * step : i * step + 200 + 37 * (i % 11)] for i in range(n)]
    docs[3] = "héllo wörld ✓ — ünïcode\nsecond line"
    docs[7] = ""
    return docs


@pytest.fixture()
def text_folder(tmp_path: Path) -> tuple[Path, list[str]]:
    """A folder of text files (one document each, nested, read in sorted order)."""
    root = tmp_path / "texts"
    docs = documents(30)
    for i, d in enumerate(docs):
        sub = root / ("b" if i % 2 else "a")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"doc{i:03d}.txt").write_text(d, encoding="utf-8")
    (root / ".hidden").write_text("never read", encoding="utf-8")
    order = sorted(range(30), key=lambda i: f"{'b' if i % 2 else 'a'}/doc{i:03d}.txt")
    return root, [docs[i] for i in order]


@pytest.fixture()
def jsonl_file(tmp_path: Path) -> tuple[Path, list[str]]:
    """A JSONL file, one document per record (field ``text``), plus another field."""
    docs = documents(60)
    path = tmp_path / "docs.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d}) + "\n")
    return path, docs


def prepared_byte_folder(root: Path, max_bytes: int, offset: int, shard_tokens: int) -> Path:
    """A folder prepared with the byte tokenizer from documents of ~1 kB cut from the
    built-in corpus (from ``offset``), shards of ``shard_tokens``."""
    from plait.data.prepare import prepare

    text = read_corpus(DataConfig(max_bytes=offset + max_bytes)).decode("utf-8", "replace")
    text = text[offset:]
    docs = [text[i : i + 700 + (i * 7) % 600] for i in range(0, len(text), 1000)]
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    prepare(str(src), str(root / "out"), "byte", shard_tokens=shard_tokens)
    return root / "out"


@pytest.fixture(scope="session")
def byte_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~150k byte tokens in shards of 10,000 (windows span shards)."""
    return prepared_byte_folder(tmp_path_factory.mktemp("bytes"), 150_000, 0, 10_000)


@pytest.fixture(scope="session")
def byte_folder_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second, smaller folder (other text), for mixtures."""
    return prepared_byte_folder(tmp_path_factory.mktemp("bytes_b"), 60_000, 200_000, 7_000)


def prepared_bpe_folder(root: Path) -> Path:
    """A folder prepared with a small BPE whose end-of-document token is id 1 (a padding
    token is id 0), so an eos id taken from the byte tokenizer (0) would be wrong."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from plait.data.prepare import prepare

    text = read_corpus(DataConfig(max_bytes=100_000)).decode("utf-8", "replace")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.split("\n\n"), trainer)
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    src = root / "docs.jsonl"
    docs = [text[i : i + 800] for i in range(0, len(text), 800)]
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    prepare(str(src), str(root / "out"), f"hf:{root / 'tokenizer.json'}", shard_tokens=5_000)
    return root / "out"


@pytest.fixture(scope="session")
def bpe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder prepared with a BPE whose eos id is 1 (see :func:`prepared_bpe_folder`)."""
    return prepared_bpe_folder(tmp_path_factory.mktemp("bpe_eos1"))
