"""``examples/own_loop.py``: a user's own loop with data, checkpoints and resume.

On 2 ranks (dp 2, ZeRO-1): an uninterrupted 6-step run, and a run stopped after 3 steps
(its checkpoint saved) then resumed to step 6. The first two run in the session's pool
(the script's ``main``); the resume runs the script as a user does, under
``torchrun --standalone --nproc-per-node 2 examples/own_loop.py ... --resume``. The
resumed steps 4-6 print the same losses as the uninterrupted run's steps 4-6 (same
layout, one thread per rank: equal bits, compared as the script prints them).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from plait.testing import WorkerContext, WorkerPool

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "own_loop.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("own_loop", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _body(ctx: WorkerContext, argv: list[str]) -> list[float]:
    return list(_module().main(argv))


def test_own_loop_resumes_as_if_uninterrupted(
    pools: Callable[[int], WorkerPool], tmp_path: Path
) -> None:
    full_dir, cut_dir = str(tmp_path / "full"), str(tmp_path / "cut")
    full = pools(2).run(_body, ["--steps", "6", "--ckpt", full_dir, "--save-every", "3"])[0]
    first = pools(2).run(_body, ["--steps", "3", "--ckpt", cut_dir, "--save-every", "3"])[0]
    assert first == full[:3]
    assert (Path(cut_dir) / "latest").read_text().strip() == "step_00000003"

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(SCRIPT), "--steps", "6", "--ckpt", cut_dir, "--save-every", "3", "--resume",
    ]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    printed = re.findall(r"^step (\d+) loss (\S+)$", r.stdout, re.M)
    assert [int(s) for s, _ in printed] == [4, 5, 6], r.stdout
    assert [v for _, v in printed] == [f"{x:.6f}" for x in full[3:]]
    assert (Path(cut_dir) / "latest").read_text().strip() == "step_00000006"
