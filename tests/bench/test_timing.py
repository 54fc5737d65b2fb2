"""plait.bench.timing: the rotation of implementations and the step-time summaries."""

from __future__ import annotations

import pytest

from plait.bench.timing import median_iqr, rotate_blocks, slowest_ms


def test_rotate_blocks_reverses_the_order_every_round() -> None:
    calls: list[tuple[str, int]] = []
    rotate_blocks(["a", "b"], 5, 2, lambda name, n: calls.append((name, n)))
    assert calls == [("a", 2), ("b", 2), ("b", 2), ("a", 2), ("a", 1), ("b", 1)]
    calls.clear()
    rotate_blocks(["a", "b", "c"], 0, 3, lambda name, n: calls.append((name, n)))
    assert calls == []
    with pytest.raises(ValueError, match="block must be at least 1"):
        rotate_blocks(["a"], 1, 0, lambda name, n: None)


def test_slowest_rank_and_median_iqr() -> None:
    assert slowest_ms([[0.001, 0.004], [0.002, 0.003]]) == [2.0, 4.0]
    med, q1, q3 = median_iqr([1.0, 2.0, 3.0, 4.0, 5.0])
    assert med == 3.0 and q1 == 1.5 and q3 == 4.5
