"""How the benchmarks time implementations against each other in the same processes.

:func:`rotate_blocks` interleaves the implementations in blocks whose order reverses
every round (A B, B A, A B, ...), so slow drift of the machine's load touches each alike;
:func:`slowest_ms` turns per-rank step times into step times (a step lasts as long as
its slowest rank) and :func:`median_iqr` summarises them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence


def rotate_blocks(
    names: Sequence[str], steps: int, block: int, run: Callable[[str, int], None]
) -> None:
    """Call ``run(name, n)`` until every name has had ``steps`` steps: each round gives
    every name one block of ``min(block, steps left)`` steps, in an order that reverses
    after every round. ``block`` must be at least 1."""
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    order = list(names)
    left = dict.fromkeys(names, steps)
    while any(left.values()):
        for name in order:
            n = min(block, left[name])
            run(name, n)
            left[name] -= n
        order.reverse()


def slowest_ms(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Step i's time in milliseconds, the slowest rank's: ``per_rank[rank][i]`` holds
    seconds, every rank the same number of steps."""
    return [max(r[i] for r in per_rank) * 1e3 for i in range(len(per_rank[0]))]


def median_iqr(xs: Sequence[float]) -> tuple[float, float, float]:
    """Median, first and third quartile of ``xs`` (at least two values)."""
    q = statistics.quantiles(xs, n=4)
    return statistics.median(xs), q[0], q[2]
