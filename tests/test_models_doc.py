"""docs/models.md's blocks marked ``run-by`` this file, run as a reader would.

* The factory module (the python block) is saved as ``mypkg/models.py`` and the page's
  ``plait train --model.factory mypkg.models:build ...`` runs in that folder; its plan
  is also checked for correctness: tp2 on the pool follows one process (float64, 3 SGD
  steps, losses to rtol 1e-9), so the shown plan is a right one, not just one that runs.
* ``plait train --model.family hf-llama ...`` runs as shown.

These are the CLI runs of both (each must name its model and write its losses).

Commands get tests/test_docs.py's TINY flags appended (a tiny model, 2 steps).
"""

from __future__ import annotations

import importlib.util
import math
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from plait.config import ModelConfig
from plait.testing import WorkerContext, WorkerPool
from tests.test_docs import TINY, Block, parse_blocks
from tests.tiny import read_metrics

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "models.md"


def _blocks() -> list[Block]:
    return [
        b for b in parse_blocks(PAGE)
        if b.marker is not None and b.marker == ("run-by", "tests/test_models_doc.py")
    ]


def _write_package(folder: Path) -> Path:
    (folder / "mypkg").mkdir()
    (folder / "mypkg" / "__init__.py").write_text("")
    module = folder / "mypkg" / "models.py"
    module.write_text(next(b.code for b in _blocks() if b.lang == "python") + "\n")
    return module


def _run(command: str, cwd: Path) -> str:
    args = shlex.split(command)
    assert args[:2] == ["plait", "train"], command
    cmd = [sys.executable, "-m", "plait", *args[1:], *shlex.split(TINY)]
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"{command}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.mark.parametrize(
    ("kind", "banner"),
    [
        ("--model.factory", "MyLM from model.factory mypkg.models:build"),
        ("--model.family hf-llama", "Hugging Face LlamaForCausalLM, 2 layers, dim 32"),
    ],
)
def test_page_commands_run(tmp_path: Path, kind: str, banner: str) -> None:
    """Each command as shown (2 ranks, tp 2): it names the model in its banner, shards it
    over tp and writes 2 finite losses."""
    if "hf-llama" in kind:
        pytest.importorskip("transformers")
    _write_package(tmp_path)
    command = next(b.code.strip() for b in _blocks() if b.lang == "bash" and kind in b.code)
    assert "--nproc 2 --tp 2" in command
    out = _run(command, tmp_path)
    assert banner in out and "tensor parallel tp 2" in out, out
    rows = read_metrics(tmp_path / "runs" / "last" / "metrics.jsonl")
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) and 0 < r["loss"] < 10 for r in rows)


def _losses(ctx: WorkerContext | None, module: str) -> list[float]:
    from plait import init_mesh
    from plait.parallel.parallelize import parallelize

    spec = importlib.util.spec_from_file_location("doc_models", module)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
    model = mod.build(cfg).double()
    mesh = ctx.mesh(tp=2) if ctx is not None else init_mesh()
    pm = parallelize(model, mesh)
    opt = torch.optim.SGD(pm.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (4, 17), generator=g)  # (batch, seq + 1)
    out = []
    for _ in range(3):
        out.append(float(pm.step(x[:, :-1], x[:, 1:])))
        opt.step()
        opt.zero_grad()
    return out


def test_page_plan_is_right(pools: Callable[[int], WorkerPool], tmp_path: Path) -> None:
    module = str(_write_package(tmp_path))
    ref = _losses(None, module)
    for got in pools(2).run(_losses, module):
        assert got == pytest.approx(ref, rel=1e-9)
    assert ref[-1] < ref[0]  # the same batch three times: it learns
