"""Weighted mixtures: proportions within 2 % over 10,000 windows (and in every prefix
within a couple of windows), a pure function of the weights evaluated per window equal to
the whole merge, and refused bad specs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from plait.config import DataConfig
from plait.data import MixtureDataset, TokenDataset, blend, make_datasets, parse_mixture
from plait.data.blending import BLOCK, Blend, merged_blend
from plait.errors import ConfigError


def test_blend_prefix_proportions() -> None:
    weights = [0.7, 0.2, 0.1]
    src, k = blend(weights, 10_000)
    for s, w in enumerate(weights):
        counts = np.cumsum(src == s)  # windows of s in every prefix
        n = np.arange(1, 10_001)
        assert np.abs(counts - w * n).max() <= 2.0
        assert abs(counts[-1] / 10_000 - w) < 0.02
        assert k[src == s].tolist() == list(range(int(counts[-1])))  # each source in order
    a, b = blend(weights, 10_000)
    assert np.array_equal(a, src) and np.array_equal(b, k)


@pytest.mark.parametrize(
    ("weights", "length"),
    [
        ([0.7, 0.2, 0.1], 10_000),
        ([1.0, 1.0], 1_001),  # ties at every time: by source order
        ([0.91] + [0.01] * 9, 5_000),  # nine small sources: their offered windows run out
        ([3.0, 1e-3, 2.0, 0.5], 20_011),
        ([1.0], 77),
    ],
)
def test_the_per_window_blend_equals_the_whole_merge(weights: list[float], length: int) -> None:
    """:class:`Blend` (per window, a block at a time) gives exactly the merge of every
    source's windows (the blend as plait built it before issue 44), at every position and
    for positions asked in any order, including across block edges."""
    want_src, want_k = merged_blend(weights, length)
    got_src, got_k = blend(weights, length)
    assert np.array_equal(got_src, want_src) and np.array_equal(got_k, want_k)
    b = Blend(weights, length)
    edges = [b.start(j) + d for j in range(1, min(40, length // BLOCK)) for d in (-1, 0)]
    rand = np.random.default_rng(length).integers(0, length, 300)
    some = np.concatenate([rand, np.asarray(edges, dtype=np.int64)])
    some = np.append(some, length - 1)
    src, k = b.locate(some)
    assert np.array_equal(src, want_src[some]) and np.array_equal(k, want_k[some])


def test_mixture_of_prepared_folders(byte_folder: Path, byte_folder_b: Path) -> None:
    spec = f"{byte_folder}:0.3,{byte_folder_b}:0.7"
    train, val = make_datasets(DataConfig(source=spec), 8, 256)
    assert isinstance(train, MixtureDataset) and isinstance(val, MixtureDataset)
    assert len(train) >= 10_000
    first = [s for s, _ in train.locate_many(range(10_000))]
    assert abs(np.mean(np.asarray(first) == 1) - 0.7) < 0.02
    # window i of the mixture is the located window of its source
    for i in (0, 1, 2, 999, 9_999):
        s, j = train.locate(i)
        x, y = train.batch([i])
        sx, sy = train.sets[s].batch([j])
        assert torch.equal(x, sx) and torch.equal(y, sy)
    some = [5, 3, 9_000, 17, 2, 4_321, 3]  # both sources, out of order, a repeat
    bx, by = train.batch(some)
    for row, i in enumerate(some):
        x, y = train.batch([i])
        assert torch.equal(bx[row], x[0]) and torch.equal(by[row], y[0])


def test_small_source_repeats() -> None:
    a = TokenDataset(np.arange(0, 41, dtype=np.uint16), 4)  # 10 windows
    b = TokenDataset(np.arange(100, 1001, dtype=np.uint16), 4)  # 225 windows
    mix = MixtureDataset([a, b], [0.5, 0.5])
    assert len(mix) == 235
    assert mix.locate(200)[0] == 0 and 0 <= mix.locate(200)[1] < 10


def test_parse_mixture() -> None:
    assert parse_mixture("data/a") is None
    assert parse_mixture("my,corpus.txt") is None  # a file name with a comma
    assert parse_mixture("a:0.7, b:0.3") == [("a", 0.7), ("b", 0.3)]
    for bad in ("a:0.7,b", "a:-1,b:1", "a:0,b:1", ":0.5,b:0.5", "a:nan,b:1"):
        with pytest.raises(ConfigError, match="mixture"):
            parse_mixture(bad)


def test_sampled_windows_keep_the_proportions(byte_folder: Path, byte_folder_b: Path) -> None:
    """The trainer's order (the sampler's seeded permutation of the mixture's windows):
    the first 10,000 windows it visits hold each source within 2 % of its weight."""
    from plait.data import BatchSampler

    train, _ = make_datasets(DataConfig(source=f"{byte_folder}:0.3,{byte_folder_b}:0.7"), 8, 256)
    assert isinstance(train, MixtureDataset)
    for seed in (0, 1):
        sampler = BatchSampler(len(train), 1_000, 0, 1, seed)
        seen = [i for step in range(10) for i in sampler.global_indices(step)]
        share = np.mean(train.blend.locate(seen)[0] == 1)
        assert abs(share - 0.7) < 0.02
