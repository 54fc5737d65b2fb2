"""Tokenizers, corpus sources, samples and the stateless batch order."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.config import DataConfig
from plait.data import (
    SEPARATOR,
    BatchSampler,
    ByteTokenizer,
    TokenDataset,
    check_enough,
    check_vocab,
    load_tokens,
    make_tokenizer,
    split_train_val,
)
from plait.errors import ConfigError, DataError


def test_byte_tokenizer_round_trip() -> None:
    tok = make_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    text = "héllo, wörld ✓\n"
    ids = tok.encode(text)
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(torch.from_numpy(ids.astype(np.int64))) == text
    with pytest.raises(DataError, match="unknown tokenizer"):
        make_tokenizer("words")


def test_tiktoken_missing_or_present() -> None:
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="tiktoken"):
            make_tokenizer("tiktoken:gpt2")
    else:  # pragma: no cover - only where tiktoken is installed
        pytest.skip("tiktoken installed; encodings may need a download")


def test_stdlib_corpus_non_empty_and_deterministic() -> None:
    cfg = DataConfig(max_bytes=200_000)
    a, b = load_tokens(cfg), load_tokens(cfg)
    assert len(a) == 200_000
    assert np.array_equal(a, b)
    text = ByteTokenizer().decode(a[:50_000])
    assert "def " in text or "import " in text


def test_text_file(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("hello world")
    assert ByteTokenizer().decode(load_tokens(DataConfig(source=str(f)))) == "hello world"
    cut = load_tokens(DataConfig(source=str(f), max_bytes=5))
    assert ByteTokenizer().decode(cut) == "hello"


def test_folder_sorted_recursive_skips_binary(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("ZZ")
    (tmp_path / "a.txt").write_text("AA")
    (tmp_path / "c.bin.dat").write_bytes(b"\x00\x01\x02")
    (tmp_path / "d.txt").write_bytes(b"\xff\xfe bad utf-8")
    (tmp_path / ".hidden").write_text("secret")
    tokens = load_tokens(DataConfig(source=str(tmp_path)))
    assert tokens.tobytes() != b""
    assert bytes(tokens.astype(np.uint8)) == b"AA" + SEPARATOR + b"ZZ"


def test_npy_and_bin(tmp_path: Path) -> None:
    arr = np.arange(1000, dtype=np.uint32) * 70
    npy = tmp_path / "t.npy"
    np.save(npy, arr)
    assert np.array_equal(load_tokens(DataConfig(source=str(npy))), arr)
    b16 = tmp_path / "t16.bin"
    arr.astype(np.uint16).tofile(b16)
    got = load_tokens(DataConfig(source=str(b16), token_dtype="uint16"))
    assert got.dtype == np.uint16 and np.array_equal(got, arr.astype(np.uint16))
    b32 = tmp_path / "t32.bin"
    arr.tofile(b32)
    assert np.array_equal(load_tokens(DataConfig(source=str(b32), token_dtype="uint32")), arr)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match=r"odd\.bin"):
        load_tokens(DataConfig(source=str(odd)))
    check_vocab(arr, 70_000, "train")
    with pytest.raises(DataError, match="vocab_size"):
        check_vocab(arr, 256, "train")


@pytest.mark.parametrize("kind", ["missing", "empty_file", "empty_folder", "empty_bin"])
def test_bad_sources_name_the_path(tmp_path: Path, kind: str) -> None:
    if kind == "missing":
        path = tmp_path / "nope.txt"
    elif kind == "empty_file":
        path = tmp_path / "empty.txt"
        path.write_bytes(b"")
    elif kind == "empty_folder":
        path = tmp_path / "folder"
        path.mkdir()
        (path / "only_binary").write_bytes(b"\x00\x00")
    else:
        path = tmp_path / "empty.bin"
        path.write_bytes(b"")
    with pytest.raises(DataError, match=re.escape(str(path))):
        load_tokens(DataConfig(source=str(path)))


def test_token_dataset_shift_and_split() -> None:
    tokens = np.arange(23, dtype=np.uint16)
    ds = TokenDataset(tokens, seq_len=5)
    assert len(ds) == 4  # 4·5 + 1 = 21 <= 23 < 26
    x, y = ds[1]
    assert x.dtype == torch.long and x.tolist() == [5, 6, 7, 8, 9]
    assert y.tolist() == [6, 7, 8, 9, 10]
    xb, yb = ds.batch([3, 0])
    assert xb.shape == yb.shape == (2, 5)
    assert xb[0].tolist() == [15, 16, 17, 18, 19] and yb[0, -1].item() == 20
    torch.testing.assert_close(xb[:, 1:], yb[:, :-1])
    with pytest.raises(IndexError):
        ds[4]
    train, val = split_train_val(np.arange(100), 0.1)
    assert len(train) == 90 and val.tolist() == list(range(90, 100))
    check_enough(ds, 4, "train")
    with pytest.raises(DataError, match="validation set has 4 sample"):
        check_enough(ds, 8, "validation")


@pytest.mark.parametrize("n", [36, 37])
def test_sampler_ranks_disjoint_union_is_global(n: int) -> None:
    g, d = 12, 4
    samplers = [BatchSampler(n, g, r, d, seed=3) for r in range(d)]
    for step in range(10):
        parts = [s.rank_indices(step) for s in samplers]
        assert all(len(p) == g // d for p in parts)
        flat = [i for p in parts for i in p]
        assert flat == samplers[0].global_indices(step)
        assert all(0 <= i < n for i in flat)
        if n % g == 0:  # no batch straddles two epochs, so no sample repeats
            assert len(set(flat)) == g


def test_sampler_deterministic_and_seeded() -> None:
    a = BatchSampler(50, 8, 0, 1, seed=1)
    b = BatchSampler(50, 8, 0, 1, seed=1)
    c = BatchSampler(50, 8, 0, 1, seed=2)
    assert [a.global_indices(s) for s in range(20)] == [b.global_indices(s) for s in range(20)]
    assert [a.global_indices(s) for s in range(3)] != [c.global_indices(s) for s in range(3)]


@pytest.mark.parametrize("order", ["feistel", "randperm"])
def test_sampler_epoch_crossing(order: str) -> None:
    from plait.data.order import make_order

    n, g = 10, 4
    s = BatchSampler(n, g, 0, 1, seed=0, order=order)
    walk2 = make_order(order, n, 0)(np.arange(2 * n))
    p0, p1 = walk2[:n].tolist(), walk2[n:].tolist()
    assert sorted(p0) == list(range(n)) and p0 != p1
    walk = [i for step in range(5) for i in s.global_indices(step)]  # 20 = 2 epochs
    assert walk == p0 + p1
    assert s.global_indices(2) == p0[8:] + p1[:2]  # straddles the boundary
    assert s.epoch_of(5) == 2.0


def test_sampler_resumable_and_reshardable() -> None:
    it = BatchSampler(29, 6, 1, 3, seed=9)
    seq = [next(iter(it)) for _ in range(12)]
    fresh = BatchSampler(29, 6, 1, 3, seed=9)
    assert seq == [fresh.rank_indices(step) for step in range(12)]
    resumed = BatchSampler(29, 6, 1, 3, seed=9)
    it2 = BatchSampler(29, 6, 1, 3, seed=9)
    for _ in range(7):
        next(iter(it2))
    resumed.load_state_dict(it2.state_dict())
    assert [next(iter(resumed)) for _ in range(5)] == seq[7:]
    # A different dp degree sees the same global batches.
    halves = [BatchSampler(29, 6, r, 2, seed=9).rank_indices(4) for r in range(2)]
    assert halves[0] + halves[1] == fresh.global_indices(4)
    with pytest.raises(DataError, match="seed"):
        resumed.load_state_dict({**it2.state_dict(), "seed": 1})


def test_sampler_micro_batches_and_errors() -> None:
    s = BatchSampler(40, 8, 1, 2, seed=0)
    micro = s.micro_batches(3, 2)
    assert len(micro) == 2 and [i for m in micro for i in m] == s.rank_indices(3)
    with pytest.raises(ConfigError, match="divisible"):
        s.micro_batches(0, 3)
    with pytest.raises(ConfigError, match="divisible"):
        BatchSampler(40, 9, 0, 2, seed=0)
    with pytest.raises(DataError):
        BatchSampler(5, 8, 0, 1, seed=0)
