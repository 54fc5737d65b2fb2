"""Packing (``plait data prepare --pack``): first-fit decreasing puts every sample whole in
exactly one window, fills >= 95 % of a realistic length mix, the windows' document ids
mark the samples, and the batches (with their document ids) resume exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from plait.cli import main
from plait.data import BackgroundLoader, BatchSampler, open_prepared, read_index
from plait.data.packed import PackedDataset
from plait.data.packing import first_fit_decreasing
from plait.data.prepare import prepare
from plait.data.sample_prepare import SampleOptions

SEQ = 256


def length_mix(n: int, seq: int, seed: int = 0) -> np.ndarray:
    """A chat-like spread: log-normal around seq/6 tokens, a long tail cut at the window."""
    rng = np.random.default_rng(seed)
    return np.clip(np.exp(rng.normal(np.log(seq / 6), 0.9, n)).astype(int), 4, seq + 1)


def test_first_fit_decreasing_places_every_sample_once() -> None:
    lengths = length_mix(500, 64, seed=1)
    windows = first_fit_decreasing(lengths.tolist(), 65)
    placed = sorted(i for w in windows for i in w)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in w) <= 65 for w in windows)
    assert sum(lengths) / (65 * len(windows)) > 0.95
    with pytest.raises(ValueError):
        first_fit_decreasing([66], 65)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Text documents of the length mix (byte tokenizer: length - 1 characters each)."""
    root = tmp_path_factory.mktemp("packed")
    rng = np.random.default_rng(2)
    words = ["alpha", "beta", "gamma", "delta", "packing", "window", "é"]
    docs = []
    for n in length_mix(600, SEQ, seed=3) - 1:
        text = " ".join(rng.choice(words, size=n)).encode()[: max(1, n)].decode(errors="ignore")
        docs.append(text or "x")
    src = root / "docs.jsonl"
    import json

    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    out = root / "out"
    opts = SampleOptions(chat=False, pack=SEQ, buffer=400)
    prepare(str(src), str(out), "byte", samples=opts, shard_tokens=5000)
    return out, docs


def test_every_sample_whole_in_one_window_and_efficiency(packed: tuple[Path, list[str]]) -> None:
    out, docs = packed
    idx = read_index(out)
    assert idx.packed is not None and len(idx.shards) > 1  # windows across several shards
    width = SEQ + 1
    stream = np.concatenate([np.fromfile(out / s["file"], dtype=idx.dtype) for s in idx.shards])
    mask = np.concatenate([np.fromfile(out / m["file"], dtype=np.uint8) for m in idx.masks or []])
    ends = np.fromfile(out / "documents.bin", dtype=np.uint64).astype(np.int64)
    assert len(stream) == idx.packed["windows"] * width and ends[-1] == len(stream)
    found = []
    begin = 0
    for end in ends:
        assert begin // width == (end - 1) // width  # inside one window
        if mask[begin:end].any():  # a sample (padding is all 0)
            assert (
                stream[end - 1] == idx.eos_id and mask[begin] == 0 and mask[begin + 1 : end].all()
            )
            found.append(bytes(stream[begin : end - 1].astype(np.uint8)).decode())
        else:
            assert (end % width == 0) and (stream[begin:end] == idx.eos_id).all()  # the tail
        begin = end
    assert sorted(found) == sorted(docs)  # every sample exactly once, whole
    eff = idx.packing_efficiency
    assert eff is not None and eff >= 0.95
    assert idx.packed["real_tokens"] == sum(len(d.encode()) + 1 for d in docs)


def test_document_ids_mark_the_samples(packed: tuple[Path, list[str]]) -> None:
    out, _ = packed
    train, val = open_prepared(str(out), SEQ, 0.1)
    assert isinstance(train, PackedDataset) and isinstance(val, PackedDataset)
    n = read_index(out).packed["windows"]  # type: ignore[index]
    assert len(train) + len(val) == n and len(val) > 0
    ends = np.fromfile(out / "documents.bin", dtype=np.uint64).astype(np.int64)
    for i in (0, len(train) - 1):
        w = train.window_number(i)
        docs = train.documents([i])[0]  # (seq,)
        lo = w * (SEQ + 1)
        inner = ends[(ends > lo) & (ends < lo + SEQ + 1)] - lo  # sample ends inside the window
        want = np.searchsorted(inner, np.arange(SEQ), side="right")
        assert docs.tolist() == want.tolist()
        _, y = train.batch([i])
        # a target is kept only inside one sample: never the first token of the next
        starts = np.concatenate([[0], inner])
        for s in starts[1:]:
            if s <= SEQ:
                assert int(y[0, s - 1]) == -100


def test_packed_batches_and_documents_resume_exactly(packed: tuple[Path, list[str]]) -> None:
    out, _ = packed
    train, _ = open_prepared(str(out), SEQ, 0.1)

    def reader(sampler: BatchSampler):  # type: ignore[no-untyped-def]
        def read(step: int) -> tuple[torch.Tensor, ...]:
            ids = sampler.rank_indices(step)
            docs = train.documents(ids)
            assert docs is not None
            return (*train.batch(ids), docs)

        return read

    first = BatchSampler(len(train), 4, 1, 2, seed=7)
    loader = BackgroundLoader(reader(first), depth=2)
    whole = [loader.get(s) for s in range(6)]
    loader.close()
    again = BatchSampler(len(train), 4, 1, 2, seed=7)
    again.load_state_dict({**first.state_dict(), "step": 3})
    loader = BackgroundLoader(reader(again), depth=2)
    resumed = [loader.get(s) for s in range(again.step, 6)]
    loader.close()
    for a, b in zip(whole[3:], resumed, strict=True):
        assert len(a) == 3 and all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def test_long_samples_refused_or_cut(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "t.txt"
    src.write_text("x" * 100)
    args = ["data", "prepare", str(src), "--tokenizer", "byte", "--pack", "32"]
    assert main([*args, "-o", str(tmp_path / "r"), "--long-samples", "refuse"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "101 tokens" in err and "--long-samples truncate" in err
    assert main([*args, "-o", str(tmp_path / "t")]) == 0
    assert "1 cut to the window" in capsys.readouterr().out
    assert main(["data", "info", str(tmp_path / "t")]) == 0
    assert "100.0% real tokens" in capsys.readouterr().out
    with pytest.raises(Exception, match=r"train\.seq_len 32"):
        open_prepared(str(tmp_path / "t"), 64, None)
