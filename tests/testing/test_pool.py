"""The worker pool itself: results in rank order, tracebacks, and recovery."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from plait.testing import WorkerContext, WorkerError, WorkerPool

M = "tests.testing.test_pool"


def _body_rank(ctx: WorkerContext, offset: int) -> tuple[int, int]:
    return ctx.rank + offset, ctx.world_size


def _body_fail_on_one(ctx: WorkerContext) -> int:
    if ctx.rank == 1:
        raise ValueError("deliberate failure on rank 1")
    return ctx.rank


def test_results_in_rank_order(pools: Callable[[int], WorkerPool]) -> None:
    assert pools(2).run(f"{M}:_body_rank", 10) == [(10, 2), (11, 2)]


def test_failure_names_rank_and_pool_recovers(pools: Callable[[int], WorkerPool]) -> None:
    pool = pools(2)
    with pytest.raises(WorkerError, match=r"rank\(s\) \[1\][\s\S]*deliberate failure") as e:
        pool.run(f"{M}:_body_fail_on_one")
    assert set(e.value.failures) == {1}
    assert pool.run(f"{M}:_body_rank", 0) == [(0, 2), (1, 2)]


def test_unknown_body_is_reported(pools: Callable[[int], WorkerPool]) -> None:
    with pytest.raises(WorkerError, match="no_such_function"):
        pools(2).run(f"{M}:no_such_function")


def test_a_function_is_a_body(pools: Callable[[int], WorkerPool]) -> None:
    assert pools(2).run(_body_rank, 5) == [(5, 2), (6, 2)]


def test_a_nested_function_is_refused_before_any_rank_runs() -> None:
    def nested(ctx: WorkerContext) -> int:
        return ctx.rank

    with pytest.raises(TypeError, match="module-level function"):
        WorkerPool(2).run(nested)
    with pytest.raises(TypeError, match="module-level function"):
        WorkerPool(2).run(lambda ctx: 0)
