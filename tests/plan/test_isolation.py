"""plait.plan is pure: no torch at all, no process group (DESIGN.md).

Checked two ways: by reading every plan module's imports (``ast``), and by running the
planner in a fresh interpreter where ``import torch`` raises — importing the real
``plait`` package (whose ``__init__`` imports lazily), not a stub.
"""

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


# modules allowed to import torch (never torch.distributed) inside a function: fit.py
# asks CUDA for the device the run will use (only when a run is about to start)
LAZY_TORCH = ("fit.py",)


def _problems(source: str, name: str) -> list[str]:
    """Forbidden imports of one plan module's source."""
    tree = ast.parse(source)
    names = _imports(tree, top_level_only=False)
    bad = [n for n in names if n.startswith(FORBIDDEN)]
    torch_names = _imports(tree, top_level_only=name in LAZY_TORCH)
    bad += [n for n in torch_names if n == "torch" or n.startswith("torch.")]
    return bad


def test_the_import_check_catches_violations() -> None:
    nested = "def f():\n    import torch.distributed as dist\n"
    assert _problems(nested, "search.py") == ["torch.distributed", "torch.distributed"]
    assert _problems(nested, "fit.py") == ["torch.distributed"]
    assert _problems("def f():\n    from plait.comm import ops\n", "search.py")
    assert _problems("import torch\n", "fit.py") == ["torch"]
    assert _problems("def f():\n    import torch\n", "fit.py") == []


def test_no_plan_module_imports_distributed_code() -> None:
    files = sorted(PLAN.glob("*.py"))
    assert len(files) >= 10
    for path in files:
        bad = _problems(path.read_text(encoding="utf-8"), path.name)
        assert not bad, f"{path.name} imports {bad}"


_NO_TORCH = (
    "import importlib.abc, sys\n"
    "class NoTorch(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'torch' or name.startswith('torch.'):\n"
    "            raise ImportError('torch is not installed here')\n"
    "sys.meta_path.insert(0, NoTorch())\n"
)


def test_the_planner_runs_where_torch_cannot_be_imported() -> None:
    code = _NO_TORCH + (
        "import plait.plan, plait.config\n"
        "from plait.plan import estimate, Layout, MODEL_PRESETS, HARDWARE_PRESETS\n"
        "from plait.cli.plan import plan_main\n"
        "plan_main(['--model', 'llama2-7b', '--search', '--devices', '8', '--top', '1'])\n"
        "plan_main(['--model', 'gpt2-124m', '--devices', '8', '--zero', '3', '--json'])\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "predicted fastest" in out.stdout


def test_the_torch_blocker_blocks() -> None:
    code = _NO_TORCH + "import plait.parallel.data\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0 and "torch is not installed here" in out.stderr


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
