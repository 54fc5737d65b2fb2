"""Imports flow one way: every module imports only from its own layer or those to its left.

Layers, left to right (DESIGN.md):

    errors → config → comm → collectives / mesh / pieces → model → parallel / optim
           → train / ps / plan / bench / testing / viz → launch → cli

Every ``import`` of every module under ``src/plait`` is read with ``ast`` — including
imports inside functions and under ``if TYPE_CHECKING:`` — and its target's layer is
compared with the importer's. Extra rules: ``plait.plan`` imports no torch and nothing
that talks to processes; only ``plait.comm`` imports ``torch.distributed`` (plus the
named launch/test-pool exceptions, which start processes); checkpoint code imports
nothing from ``plait.parallel``; no two sub-packages import each other. The checker is
itself checked on synthetic sources, so it cannot pass vacuously.
"""

from __future__ import annotations

import ast
from pathlib import Path

import plait

SRC = Path(plait.__file__).parent

LAYERS: list[tuple[str, ...]] = [
    ("plait.errors",),
    ("plait.config", "plait.config_io", "plait.config_checks", "plait.presets"),
    ("plait.comm",),
    ("plait.collectives", "plait.mesh", "plait.pieces"),
    ("plait.model",),
    ("plait.parallel", "plait.optim"),
    ("plait.train", "plait.ps", "plait.plan", "plait.bench", "plait.testing", "plait.viz"),
    ("plait.launch",),
    ("plait.cli", "plait.__main__", "plait"),  # the root package's lazy table names all
]

DISTRIBUTED_ALLOWED = {
    # the elastic agent's launcher and its error recording start and watch processes
    "plait.launch.local",
    "plait.cli.train",
    "plait.cli",
}
"""Modules outside plait.comm that may import torch.distributed (process launch only)."""

CHECKPOINT = ("plait.train.checkpoint", "plait.train.reshard", "plait.train.state")


def layer_of(module: str) -> int:
    """The layer index of a plait module (longest matching prefix)."""
    best, where = -1, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, where = len(name), i
    if where < 0:
        raise AssertionError(f"{module} is in no layer; add it to LAYERS")
    return where


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, imported module)`` of every import statement, relative ones resolved."""
    out: list[tuple[int, str]] = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((node.lineno, base))
            # ``from plait import comm`` imports the submodule plait.comm
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names if base == "plait"]
    return out


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every rule a module's source breaks, one line each."""
    mine = layer_of(module)
    bad: list[str] = []
    for line, target in imports_of(source, module, is_package):
        where = f"{module}:{line} imports {target}"
        if target == "plait" or not target.startswith("plait."):
            comm_ok = module.startswith("plait.comm") or module in DISTRIBUTED_ALLOWED
            if target.startswith("torch.distributed") and not comm_ok:
                bad.append(f"{where}: only plait.comm talks to torch.distributed")
            is_torch = target == "torch" or target.startswith("torch.")
            if module.startswith("plait.plan") and is_torch:
                bad.append(f"{where}: plait.plan must import no torch")
            continue
        theirs = layer_of(target)
        if theirs > mine:
            bad.append(f"{where}: layer {LAYERS[mine]} imports layer {LAYERS[theirs]}")
        if module.startswith("plait.plan") and target.startswith(
            ("plait.comm", "plait.mesh", "plait.testing", "plait.bench", "plait.parallel")
        ):
            bad.append(f"{where}: plait.plan is pure arithmetic (no processes, no torch)")
        if module.startswith(CHECKPOINT) and target.startswith("plait.parallel"):
            bad.append(f"{where}: checkpoint code names no parallelism")
    return bad


def _modules() -> list[tuple[Path, str]]:
    return [(p, module_name(p)) for p in sorted(SRC.rglob("*.py"))]


def _top(module: str) -> str:
    """The sub-package a module belongs to (``plait.parallel``), or the module itself."""
    parts = module.split(".")
    if len(parts) > 1 and (SRC / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


def test_the_checker_flags_what_it_should() -> None:
    assert violations("from plait.train.trainer import Trainer\n", "plait.parallel.data")
    assert violations("def f():\n    from plait.parallel import zero\n", "plait.config")
    typing_only = "if TYPE_CHECKING:\n    from plait.train.state import TrainState\n"
    assert violations(typing_only, "plait.parallel.data")
    assert violations("import torch\n", "plait.plan.search")
    assert violations("import torch.distributed as dist\n", "plait.parallel.data")
    assert violations("from plait.parallel.tensor import layers\n", "plait.train.checkpoint")
    assert violations("from ..train import trainer\n", "plait.parallel.data")  # relative
    assert violations("from plait import optim\n", "plait.model.transformer")
    assert not violations("from plait.comm import all_reduce\nimport torch\n", "plait.mesh")
    assert not violations("from plait.parallel.zero import flat\n", "plait.parallel.data")


def test_imports_flow_one_way() -> None:
    modules = _modules()
    assert len(modules) > 60
    bad = [
        v
        for path, name in modules
        for v in violations(path.read_text("utf-8"), name, path.name == "__init__.py")
    ]
    assert not bad, "\n".join(bad)


def test_no_two_subpackages_import_each_other() -> None:
    edges: dict[str, set[str]] = {}
    for path, name in _modules():
        for _, target in imports_of(path.read_text("utf-8"), name, path.name == "__init__.py"):
            same = _top(target) == _top(name)
            if target.startswith("plait.") and not same and name != "plait" and "." in _top(name):
                edges.setdefault(_top(name), set()).add(_top(target))
    packages = {a for a in edges if (SRC / a.split(".")[1]).is_dir()}
    cycles = sorted(
        f"{a} <-> {b}"
        for a, outs in edges.items()
        for b in outs
        if a < b and a in edges.get(b, ()) and {a, b} <= packages
    )
    assert not cycles, cycles
