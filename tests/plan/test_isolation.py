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


# modules allowed to import torch (never torch.distributed) inside a function: the
# calibration measures the machine; fit.py asks CUDA for the device the run will use
LAZY_TORCH = ("calibrate.py", "measure.py", "fit.py")


def _problems(source: str, name: str) -> list[str]:
    """Forbidden imports of one plan module's source."""
    tree = ast.parse(source)
    # calibrate.py measures collectives: distributed code only inside its functions
    names = _imports(tree, top_level_only=name == "calibrate.py")
    bad = [n for n in names if n.startswith(FORBIDDEN)]
    torch_names = _imports(tree, top_level_only=name in LAZY_TORCH)
    bad += [n for n in torch_names if n == "torch" or n.startswith("torch.")]
    return bad


def test_the_import_check_catches_violations() -> None:
    nested = "def f():\n    import torch.distributed as dist\n"
    assert _problems(nested, "search.py") == ["torch.distributed", "torch.distributed"]
    assert _problems(nested, "fit.py") == ["torch.distributed"]
    assert _problems("from plait.comm import ops\n", "calibrate.py")
    assert _problems("import torch\n", "fit.py") == ["torch"]
    assert _problems("def f():\n    import torch\n", "fit.py") == []


def test_no_plan_module_imports_distributed_code() -> None:
    files = sorted(PLAN.glob("*.py"))
    assert len(files) >= 10
    for path in files:
        bad = _problems(path.read_text(encoding="utf-8"), path.name)
        assert not bad, f"{path.name} imports {bad}"


def test_the_planner_runs_without_torch_distributed() -> None:
    # load plait.plan without plait/__init__.py (which imports the whole library): the
    # planner and everything it imports must not load torch.distributed, nor even torch
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('plait'); pkg.__path__ = [{str(PLAN.parent)!r}]\n"
        "sys.modules['plait'] = pkg\n"
        "from plait.cli.plan import plan_main\n"
        "plan_main(['--model', 'llama2-7b', '--search', '--devices', '8', '--top', '1'])\n"
        "plan_main(['--model', 'gpt2-124m', '--devices', '8', '--zero', '3', '--json'])\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "predicted fastest" in out.stdout


def test_the_planner_runs_without_a_process_group() -> None:
    code = (
        "import sys\n"
        "from plait.cli.plan import plan_main\n"
        "plan_main(['--model', 'llama2-7b', '--search', '--devices', '8', '--top', '1'])\n"
        "assert 'plait.bench.calibrate' not in sys.modules\n"
        "import torch.distributed as dist\n"
        "assert not dist.is_initialized()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "predicted fastest" in out.stdout
