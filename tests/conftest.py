"""Shared fixtures: session-scoped pools of gloo ranks (world sizes 2, 4 and 8).

A pool starts on first use and lives for the whole session, so a multi-process test
costs milliseconds of set-up. Bodies are module-level functions named
``"tests.<package>.<module>:<function>"`` and run on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from plait.testing import WorkerPool


class Pools:
    """Lazily started pools, one per world size."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def __call__(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is None:
            pool = WorkerPool(world_size, comm_timeout_s=60.0)
            self._pools[world_size] = pool
        return pool

    def close(self) -> None:
        for p in self._pools.values():
            p.close()


@pytest.fixture(scope="session")
def pools() -> Iterator[Callable[[int], WorkerPool]]:
    """``pools(n)`` returns the session's pool of ``n`` ranks."""
    p = Pools()
    yield p
    p.close()
