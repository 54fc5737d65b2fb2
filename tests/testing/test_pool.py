"""The worker pool itself: results in rank order, tracebacks, and recovery."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

from plait.testing import WorkerContext, WorkerError, WorkerPool
from plait.testing.pool import body_address

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


def test_a_function_becomes_its_module_and_name() -> None:
    assert body_address(_body_rank) == f"{M}:_body_rank"
    assert body_address(f"{M}:_body_rank") == f"{M}:_body_rank"


class _Bodies:
    def method(self, ctx: WorkerContext) -> int:
        return ctx.rank


def _closure_over(offset: int) -> Callable[[WorkerContext], int]:
    def body(ctx: WorkerContext) -> int:
        return ctx.rank + offset

    return body


@pytest.mark.parametrize(
    "body",
    [
        lambda ctx: 0,
        _closure_over(1),
        _Bodies().method,
        functools.partial(_body_rank, offset=1),
    ],
    ids=["lambda", "closure", "method", "partial"],
)
def test_what_workers_cannot_import_is_refused_before_any_rank_runs(
    body: Callable[..., Any],
) -> None:
    pool = WorkerPool(2)
    with pytest.raises(TypeError, match="module-level function"):
        pool.run(body)
    assert not pool.started  # refused before any process was started


def test_a_nested_function_says_where_to_define_it() -> None:
    def nested(ctx: WorkerContext) -> int:
        return ctx.rank

    with pytest.raises(TypeError, match="define it at the top level of its module"):
        body_address(nested)
