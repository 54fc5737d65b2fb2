"""The README's own-loop example runs as written, on a world of 8 gloo ranks.

The block under "Your own training loop" is taken from README.md verbatim and executed
on every rank of the session pool (whose world is already joined, as torchrun's is);
every rank must finish with a finite loss and grad norm.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

from plait.testing import WorkerContext, WorkerPool

README = Path(__file__).resolve().parents[1] / "README.md"


def own_loop_block() -> str:
    """The first python block after the heading "## Your own training loop"."""
    text = README.read_text("utf-8")
    section = text[text.index("## Your own training loop") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the README's own-loop section has no python block"
    return match.group(1)


def _body_run(ctx: WorkerContext, code: str) -> tuple[float, float]:
    scope: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), scope)
    loss, report = scope["loss"], scope["report"]
    return float(loss.item()), float(report.grad_norm)  # type: ignore[attr-defined]


def test_own_loop_example_runs_on_eight_ranks(pools: Callable[[int], WorkerPool]) -> None:
    code = own_loop_block()
    assert "plait.parallelize(" in code and "plait.optim.Optimizer(" in code
    results = pools(8).run(_body_run, code)
    for loss, norm in results:
        assert math.isfinite(loss) and 0 < loss < 10 and math.isfinite(norm)
    assert len({round(r[0], 12) for r in results}) == 1  # the dp-averaged loss, everywhere
