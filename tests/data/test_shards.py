"""Windows over memory-mapped shards: equal to windows of the whole stream, spanning
shards; held-out documents split deterministically; the background loader."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.config import DataConfig
from plait.data import (
    BackgroundLoader,
    BatchSampler,
    TokenDataset,
    make_datasets,
    open_prepared,
    read_index,
)
from plait.data.shards import held_out, runs
from plait.errors import DataError


def whole_stream(folder: Path) -> np.ndarray:
    idx = read_index(folder)
    return np.concatenate([np.fromfile(folder / s["file"], dtype=idx.dtype) for s in idx.shards])


def test_all_documents_windows_equal_the_stream(byte_folder: Path) -> None:
    train, val = open_prepared(str(byte_folder), 32, None)
    assert val is None
    ref = TokenDataset(whole_stream(byte_folder), 32)
    assert len(train) == len(ref) and train.num_tokens == ref.num_tokens
    idx = list(range(len(ref)))  # every window, many of them across shard boundaries
    for a, b in zip(train.batch(idx), ref.batch(idx), strict=True):
        assert torch.equal(a, b)
    assert train.eos_id == 0


def test_held_out_documents(byte_folder: Path) -> None:
    stream = whole_stream(byte_folder)
    ends = np.fromfile(byte_folder / "documents.bin", dtype=np.uint64).astype(np.int64)
    begins = np.concatenate([[0], ends[:-1]])
    mask = held_out(len(ends), 0.1)
    assert np.array_equal(mask, held_out(len(ends), 0.1))  # a pure function
    assert 0.03 < mask.mean() < 0.2
    train, val = open_prepared(str(byte_folder), 16, 0.1)
    assert val is not None
    for ds, m in ((train, ~mask), (val, mask)):
        joined = np.concatenate([stream[b:e] for b, e, k in zip(begins, ends, m, strict=True) if k])
        ref = TokenDataset(joined, 16)
        assert len(ds) == len(ref)
        some = list(range(0, len(ref), 7))
        assert torch.equal(ds.batch(some)[0], ref.batch(some)[0])
    assert train.num_tokens + val.num_tokens == len(stream)


def test_runs() -> None:
    a, b = runs(np.array([1, 1, 0, 1, 0, 0, 1], dtype=bool))
    assert a.tolist() == [0, 3, 6] and b.tolist() == [2, 4, 7]


def test_data_val_folder_and_vocab_refusal(byte_folder: Path, byte_folder_b: Path) -> None:
    train, val = make_datasets(DataConfig(source=str(byte_folder), val=str(byte_folder_b)), 32, 256)
    assert train.num_tokens == read_index(byte_folder).tokens  # every document trains
    assert val.num_tokens == read_index(byte_folder_b).tokens
    with pytest.raises(DataError, match=r"vocabulary of 256 tokens but model\.vocab_size is 200"):
        make_datasets(DataConfig(source=str(byte_folder)), 32, 200)
    with pytest.raises(DataError, match="not a prepared folder"):
        make_datasets(DataConfig(source=str(byte_folder), val=str(byte_folder.parent)), 32, 256)


def test_background_loader_equals_direct_reads(byte_folder: Path) -> None:
    train, _ = open_prepared(str(byte_folder), 32, 0.05)
    sampler = BatchSampler(len(train), 8, 1, 2, seed=3)

    def read(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return train.batch(sampler.rank_indices(step))

    loader = BackgroundLoader(read, depth=3)
    try:
        for step in [0, 1, 2, 3, 7, 8, 2, 3]:  # in order, a jump, a jump back
            x, y = loader.get(step)
            rx, ry = read(step)
            assert torch.equal(x, rx) and torch.equal(y, ry)
    finally:
        loader.close()
    assert not any(t.name == "plait-data-loader" for t in threading.enumerate())


def test_background_loader_raises_the_threads_error() -> None:
    def read(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step == 2:
            raise DataError("boom at 2")
        return torch.zeros(1), torch.zeros(1)

    loader = BackgroundLoader(read)
    loader.get(0)
    loader.get(1)
    with pytest.raises(DataError, match="boom at 2"):
        loader.get(2)
    loader.close()


def test_no_truncation_note_for_a_prepared_folder(byte_folder: Path) -> None:
    from plait.data import truncation_note

    assert truncation_note(DataConfig(source=str(byte_folder), max_bytes=1000)) is None
    assert truncation_note(DataConfig(source=str(byte_folder.parent), max_bytes=1000))


class _Owner:
    def read(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((1,), step), torch.full((1,), step)


def test_loader_thread_ends_with_its_owner() -> None:
    import gc

    owner = _Owner()
    loader = BackgroundLoader(owner.read, depth=1)
    assert int(loader.get(5)[0]) == 5
    thread = loader._thread
    assert thread is not None and thread.is_alive()
    del owner
    gc.collect()
    thread.join(10)  # it notices within one 0.1 s wait
    assert not thread.is_alive()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loader_pins_batches_for_cuda(byte_folder: Path) -> None:
    train, _ = open_prepared(str(byte_folder), 32, 0.05)
    sampler = BatchSampler(len(train), 8, 0, 1, seed=0)

    def read(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return train.batch(sampler.rank_indices(step))

    loader = BackgroundLoader(read, depth=2, pin=True)
    try:
        for step in range(3):
            x, y = loader.get(step)
            assert x.is_pinned() and y.is_pinned()
            assert x.is_contiguous() and y.is_contiguous()
            on_gpu = x.to("cuda", non_blocking=True)
            assert torch.equal(on_gpu.cpu(), read(step)[0])
    finally:
        loader.close()


def test_pinned_batches_are_contiguous_buffers(
    byte_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The windows' inputs and targets are views (``w[:, :-1]``, ``w[:, 1:]``); the loader
    copies each into a contiguous buffer from the pinned allocator (replaced here by the
    plain one: the CPU-only machine has no page-locking), never pinning the view itself
    (a strided pinned tensor makes the asynchronous copy go through pageable memory)."""
    import plait.data.loader as loader_mod

    asked: list[tuple[tuple[int, ...], torch.dtype]] = []

    def fake_pinned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        asked.append((tuple(shape), dtype))
        return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(loader_mod, "_pinned_empty", fake_pinned_empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pytest.fail("pinned a view"))
    train, _ = open_prepared(str(byte_folder), 32, 0.05)
    sampler = BatchSampler(len(train), 4, 0, 1, seed=0)

    def read(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return train.batch(sampler.rank_indices(step))

    assert not read(0)[0].is_contiguous()  # the case that matters: views of the windows
    loader = BackgroundLoader(read, depth=1, pin=True)
    try:
        x, y = loader.get(0)
    finally:
        loader.close()
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x, read(0)[0]) and torch.equal(y, read(0)[1])
    assert asked[:2] == [((4, 32), x.dtype), ((4, 32), y.dtype)]
