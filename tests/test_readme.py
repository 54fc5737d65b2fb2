"""The README's own-loop example runs as written: under torchrun, and on 8 gloo ranks.

The block under "Your own training loop" is taken from README.md verbatim and

* saved as ``train.py`` and run with ``torchrun --standalone --nproc-per-node 2`` (the
  command the README gives): ``plait.init_mesh`` joins torchrun's world by itself, with
  no ``init_process_group`` in the example;
* executed on every rank of the session pool of 8 (whose world is already joined:
  ``init_mesh`` uses it as it is).

Every rank must finish with a finite loss and grad norm, the same on every rank.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
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


def test_own_loop_example_runs_verbatim_under_torchrun(tmp_path: Path) -> None:
    code = own_loop_block()
    assert "init_process_group" not in code
    (tmp_path / "train.py").write_text(code, "utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "train.py"]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # The two ranks share stdout, so their lines may run together: match numbers only.
    num = r"(\d+(?:\.\d+)?(?:e[-+]?\d+)?|nan|inf)"
    lines = re.findall(rf"loss {num}, grad norm {num}", r.stdout)
    assert len(lines) == 2, r.stdout  # one line per rank
    assert len(set(lines)) == 1  # dp 1 x tp 2: both ranks report the same global values
    loss, norm = (float(v) for v in lines[0])
    assert 0 < loss < 10 and math.isfinite(norm)
