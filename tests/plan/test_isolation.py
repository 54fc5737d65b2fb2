"""plait.plan is pure: no torch.distributed, no process group (DESIGN.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import plait.plan

PLAN = Path(plait.plan.__file__).parent
FORBIDDEN = ("torch.distributed", "plait.comm", "plait.mesh", "plait.parallel", "plait.testing")


def _imports(tree: ast.AST, top_level_only: bool) -> list[str]:
    nodes = tree.body if top_level_only and isinstance(tree, ast.Module) else ast.walk(tree)
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_no_plan_module_imports_distributed_code() -> None:
    files = sorted(PLAN.glob("*.py"))
    assert len(files) >= 10
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        # calibrate.py measures collectives: only inside its functions
        names = _imports(tree, top_level_only=path.name == "calibrate.py")
        bad = [n for n in names if n.startswith(FORBIDDEN)]
        assert not bad, f"{path.name} imports {bad}"
        if path.name not in ("calibrate.py",):
            assert not [n for n in names if n == "torch" or n.startswith("torch.")], path.name


def test_the_planner_runs_without_a_process_group() -> None:
    code = (
        "import sys\n"
        "from plait.plan.cli import plan_main\n"
        "plan_main(['--model', 'llama2-7b', '--search', '--devices', '8', '--top', '1'])\n"
        "assert 'plait.plan.calibrate' not in sys.modules\n"
        "import torch.distributed as dist\n"
        "assert not dist.is_initialized()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "predicted fastest" in out.stdout
