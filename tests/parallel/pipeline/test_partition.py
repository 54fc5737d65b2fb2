"""Stage balancing: the exact min-max split, profiling, and agreement across ranks."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest
import torch

from plait.errors import ConfigError
from plait.model import Transformer
from plait.model.transformer import FeedForward
from plait.parallel.pipeline.partition import (
    best_partition,
    choose_boundaries,
    format_partition,
    measured_boundaries,
    profile_blocks,
)
from plait.parallel.pipeline.split import equal_boundaries
from plait.testing import WorkerContext, WorkerPool
from tests.parallel.pipeline.test_runtime import SEQ, model_config

M = "tests.parallel.pipeline.test_partition"


def _brute(costs: list[float], pieces: int, first: float, last: float) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), pieces - 1):
        b = [0, *cuts, n]
        sums = [sum(costs[b[k] : b[k + 1]]) for k in range(pieces)]
        sums[0] += first
        sums[-1] += last
        best = min(best, max(sums))
    return best


def test_best_partition_is_the_exact_min_max_split() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        pieces = rng.randint(1, n)
        costs = [rng.choice([0.5, 1.0, 3.0, 10.0]) * rng.random() for _ in range(n)]
        first, last = rng.random(), 2 * rng.random()
        b = best_partition(costs, pieces, first, last)
        assert len(b) == pieces + 1 and b[0] == 0 and b[-1] == n
        assert all(b[k] < b[k + 1] for k in range(pieces))
        sums = [sum(costs[b[k] : b[k + 1]]) for k in range(pieces)]
        sums[0] += first
        sums[-1] += last
        assert max(sums) == pytest.approx(_brute(costs, pieces, first, last), rel=1e-12)


def test_memory_cap_constrains_the_split() -> None:
    costs = [1.0, 1.0, 1.0, 1.0]
    assert best_partition(costs, 2) == [0, 2, 4]
    # the first two blocks are too big to share a piece: time alone would pair them
    memory = [6.0, 6.0, 1.0, 1.0]
    assert best_partition(costs, 2, memory=memory, memory_cap=8.0) == [0, 1, 4]
    with pytest.raises(ConfigError, match=r"no split of 4 blocks into 2 pieces .* memory cap"):
        best_partition(costs, 2, memory=memory, memory_cap=5.0)


def uneven_model() -> Transformer:
    """8 blocks; blocks 0 and 1 get a 16384-wide MLP (256x the default width: ~100x
    the block's FLOPs), enough to dominate the per-call overheads of a tiny block."""
    model = Transformer(model_config(), seed=3)
    for i in (0, 1):
        model.layers[i].feed_forward = FeedForward(16, 16384)  # type: ignore[union-attr]
    return model


def test_measured_split_beats_equal_count_on_uneven_blocks() -> None:
    """Predicted from one measured profile: the optimal split's slowest piece is well
    under the equal-count split's (which puts both heavy blocks in piece 0)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the pool's ranks: no intra-op thread contention
    try:
        profile = profile_blocks(uneven_model(), micro=4, seq=SEQ, repeats=5)
    finally:
        torch.set_num_threads(threads)
    light = sorted(b.seconds for b in profile.blocks[2:])[3]
    assert min(profile.blocks[0].seconds, profile.blocks[1].seconds) > 3 * light
    assert profile.blocks[0].param_bytes > 30 * profile.blocks[2].param_bytes
    assert profile.blocks[0].activation_bytes > profile.blocks[2].activation_bytes
    equal = equal_boundaries(8, 4)
    chosen = measured_boundaries(profile, 4)
    assert chosen[1] == 1  # the two heavy blocks end up in different pieces
    slow_measured = max(profile.piece_seconds(chosen))
    slow_equal = max(profile.piece_seconds(equal))
    assert slow_measured < 0.75 * slow_equal, (chosen, slow_measured, slow_equal)
    text = format_partition(profile, chosen, "measured")
    assert f"boundaries {chosen}" in text and text.count("predicted") == 4


def _body_choose(ctx: WorkerContext) -> tuple[list[int], str]:
    mesh = ctx.mesh(dp=1, pp=2)
    torch.manual_seed(ctx.rank)
    return choose_boundaries(uneven_model(), mesh, 4, "measured", micro=2, seq=SEQ)


def test_ranks_agree_on_measured_boundaries(pools: Callable[[int], WorkerPool]) -> None:
    (b0, text), (b1, _) = pools(2).run(f"{M}:_body_choose")
    assert b0 == b1 and b0[1] == 1
    assert "pipeline split (measured)" in text and "equal-count, for comparison" in text


def test_uneven_boundaries_train_like_one_process(
    pools: Callable[[int], WorkerPool],
) -> None:
    """A measured-style split ([0, 1, 2, 5, 8] at pp 2 x 2 chunks) trains to the
    one-device weights like the equal split (tolerance of test_runtime)."""
    from tests.parallel.pipeline.test_runtime import check_parity, reference

    results = pools(2).run(
        "tests.parallel.pipeline.test_runtime:_body_pipeline",
        "interleaved",
        4,
        2,
        False,
        [0, 1, 2, 5, 8],
    )
    check_parity(results, reference(False))
