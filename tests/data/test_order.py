"""The data order in constant memory (issue 44): the Feistel permutation is a bijection
(exhaustively on small ranges, statistically on large ones), the order is the same for
every data-parallel degree, the loader state records its algorithm and resumes bit-exact,
and a loader state written before orders had names resumes with the old order exactly
(``fixtures/data_order/randperm_before.json``, written by the code before this change)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from plait.data import BatchSampler
from plait.data.order import FeistelOrder, FeistelPermutation, RandpermOrder, epoch_seed
from plait.errors import ConfigError, DataError

FIXTURES = Path(__file__).parents[1] / "fixtures"
BEFORE = FIXTURES / "data_order" / "randperm_before.json"
WRITTEN_BEFORE = FIXTURES / "written_before" / "step_00000002" / "metadata.json"


def test_feistel_is_a_bijection_on_every_small_range() -> None:
    for n in [*range(1, 130), 255, 256, 257, 1000, 4095, 4096, 4097, 65_537]:
        for seed in (0, 12345):
            got = FeistelPermutation(n, seed)(np.arange(n))
            assert got.dtype == np.int64
            assert np.array_equal(np.sort(got), np.arange(n)), (n, seed)


@pytest.mark.parametrize("n", [200_000_000, 3 * 10**12])
def test_feistel_looks_random_on_large_ranges(n: int) -> None:
    """100,000 consecutive offsets of a large range: distinct, inside it, spread evenly
    (chi-square over 20 bins), not locally ordered; another seed gives other images."""
    perm = FeistelPermutation(n, 7)
    offsets = np.arange(n // 3, n // 3 + 100_000, dtype=np.int64)
    got = perm(offsets)
    assert got.min() >= 0 and got.max() < n
    assert len(np.unique(got)) == len(got)  # no collision among 100,000 images
    counts = np.bincount((got * 20 // n).astype(np.int64), minlength=20)
    chi2 = float((((counts - 5_000) ** 2) / 5_000).sum())
    assert chi2 < 50.0  # 19 degrees of freedom: p < 1e-4 above 43.8
    steps = np.abs(np.diff(got.astype(np.float64))) / n
    assert abs(steps.mean() - 1 / 3) < 0.01  # |U - V| of independent uniforms: 1/3
    other = FeistelPermutation(n, 8)(offsets)
    assert np.mean(other == got) < 0.001


def test_epochs_differ_and_positions_are_the_concatenated_epochs() -> None:
    n = 97
    order = FeistelOrder(n, 5)
    walk = order(np.arange(3 * n))
    for e in range(3):
        part = walk[e * n : (e + 1) * n]
        assert np.array_equal(part, FeistelPermutation(n, epoch_seed(5, e))(np.arange(n)))
        assert sorted(part.tolist()) == list(range(n))
    assert not np.array_equal(walk[:n], walk[n : 2 * n])


@pytest.mark.parametrize("order", ["feistel", "randperm"])
def test_dp1_and_dp2_see_the_same_order(order: str) -> None:
    n, g = 101, 12  # batches straddle epochs
    one = BatchSampler(n, g, 0, 1, seed=3, order=order)
    two = [BatchSampler(n, g, r, 2, seed=3, order=order) for r in range(2)]
    four = [BatchSampler(n, g, r, 4, seed=3, order=order) for r in range(4)]
    for step in (0, 1, 8, 9, 50):
        want = one.global_indices(step)
        assert [i for s in two for i in s.rank_indices(step)] == want
        assert [i for s in four for i in s.rank_indices(step)] == want
    epoch = [i for step in range(9) for i in one.global_indices(step)][:n]  # 9 x 12 >= n
    assert sorted(epoch) == list(range(n))


def test_the_state_records_the_order_and_resumes_bit_exact() -> None:
    run = BatchSampler(1_000_003, 16, 1, 2, seed=11)
    it = iter(run)
    for _ in range(5):
        next(it)
    state = run.state_dict()
    assert state["order"] == "feistel" and state["step"] == 5
    later = [next(it) for _ in range(4)]
    resumed = BatchSampler(1_000_003, 16, 0, 4, seed=11)  # another dp degree
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as the checkpoint stores it
    halves = [BatchSampler(1_000_003, 16, r, 2, seed=11) for r in range(2)]
    for k in range(4):
        assert later[k] == halves[1].rank_indices(5 + k)
    assert resumed.step == 5 and resumed.order == "feistel"
    with pytest.raises(DataError, match="order 'shuffle9' is not one of"):
        resumed.load_state_dict({**state, "order": "shuffle9"})
    with pytest.raises(ConfigError, match="unknown data order"):
        BatchSampler(100, 4, 0, 1, seed=0, order="shuffle9")


def test_an_old_loader_state_resumes_with_the_old_order() -> None:
    """The loader state of ``written_before``'s checkpoint (saved before orders had names)
    and the fixture's cases: a fresh sampler (Feistel by default) takes the old order on
    load and gives exactly the old code's batches, on any dp degree; saving records it."""
    before = json.loads(BEFORE.read_text())
    old_state = json.loads(WRITTEN_BEFORE.read_text())["sampler"]
    assert "order" not in old_state
    first = before["cases"][0]
    assert {k: first[k] for k in ("num_samples", "global_batch", "seed")} == {
        k: old_state[k] for k in ("num_samples", "global_batch", "seed")
    }
    for case in before["cases"]:
        n, g, seed = case["num_samples"], case["global_batch"], case["seed"]
        state = {**old_state, "num_samples": n, "global_batch": g, "seed": seed}
        for dp in (1, 2):
            samplers = [BatchSampler(n, g, r, dp, seed) for r in range(dp)]
            for s in samplers:
                assert s.order == "feistel"
                s.load_state_dict({**state, "step": case["from_step"]})
                assert s.order == "randperm" and s.state_dict()["order"] == "randperm"
            for step, want in case["global"].items():
                got = [i for s in samplers for i in s.rank_indices(int(step))]
                assert got == want, (n, g, seed, step)
        new = BatchSampler(n, g, 0, 1, seed)
        assert new.global_indices(int(next(iter(case["global"])))) != next(
            iter(case["global"].values())
        )
    assert RandpermOrder(64, 7).permutation(0).dtype == np.int32  # 4 bytes a window
