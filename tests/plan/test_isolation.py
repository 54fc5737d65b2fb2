"""plait.plan is pure: no torch at all, no process group (docs/architecture.md, layer 6).

Checked two ways: by reading every plan module's imports (``ast``, nested imports
included: the planner imports torch nowhere), and by running the config checks, an
estimate of a layout built with ``Layout.from_config`` and ``plait plan`` in a fresh
interpreter where ``import torch`` raises — importing the real ``plait`` package (whose
``__init__`` imports lazily), not a stub.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import plait.plan

PLAN = Path(plait.plan.__file__).parent
FORBIDDEN = (
    "plait.comm",
    "plait.mesh",
    "plait.model",
    "plait.parallel",
    "plait.testing",
    "plait.bench",
)
"""plait modules that need torch or a process group (``tests/test_layers.py`` checks the
whole layer rule; this is the torch-free part)."""


def _imports(tree: ast.AST) -> list[str]:
    """Every module an ``import`` or ``from ... import`` anywhere in ``tree`` names."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def _problems(source: str) -> list[str]:
    """Forbidden imports of one plan module's source (anywhere in it, nested too)."""
    names = _imports(ast.parse(source))
    return [n for n in names if n.startswith(FORBIDDEN) or n == "torch" or n.startswith("torch.")]


def test_the_import_check_catches_violations() -> None:
    nested = "def f():\n    import torch.distributed as dist\n"
    assert _problems(nested) == ["torch.distributed"]
    assert _problems("def f():\n    from plait.comm import ops\n") == [
        "plait.comm",
        "plait.comm.ops",
    ]
    assert _problems("import torch\n") == ["torch"]
    assert _problems("if True:\n    from torch import nn\n") == ["torch", "torch.nn"]
    assert _problems("from plait.bench.calibrate import calibrate\n")
    assert _problems("import math\nfrom plait.config import Config\n") == []


def test_no_plan_module_imports_torch_or_distributed_code() -> None:
    files = sorted(PLAN.glob("*.py"))
    assert len(files) >= 10
    for path in files:
        bad = _problems(path.read_text(encoding="utf-8"))
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
        "import plait, plait.plan, plait.config\n"
        "from plait.config.toml_io import load_config\n"
        "from plait.plan import HARDWARE_PRESETS, MODEL_SPECS, PRECISIONS, RUNTIMES, Layout\n"
        "from plait.plan import Query, estimate\n"
        "cfg = load_config(None, ['parallel.tp=2', 'parallel.zero=1'])\n"
        "cfg.validate(8)\n"
        "layout = Layout.from_config(cfg, 8)\n"
        "q = Query.of_layout(MODEL_SPECS['gpt2-124m'], layout, HARDWARE_PRESETS['a100-80gb'],\n"
        "                    PRECISIONS['bf16-mixed'], RUNTIMES['plait'], 1024, headroom=0.0)\n"
        "e = estimate(q, layout)\n"
        "assert e.fits and e.tokens_per_s > 0, e\n"
        "print('estimate', layout.describe(), round(e.tokens_per_s))\n"
        "from plait.cli.plan import plan_main\n"
        "plan_main(['--model', 'llama2-7b', '--search', '--devices', '8', '--top', '1'])\n"
        "plan_main(['--model', 'gpt2-124m', '--devices', '8', '--zero', '3', '--json'])\n"
        "assert plait.Config is plait.config.Config\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("estimate ")
    assert "predicted fastest" in out.stdout


def test_the_torch_blocker_blocks() -> None:
    code = _NO_TORCH + "import plait.parallel.data_parallel\n"
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
