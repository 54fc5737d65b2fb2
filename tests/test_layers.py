"""Imports flow one way: every module imports only from its own layer or those to its left.

Layers, left to right (docs/architecture.md draws them, with what each package owns; the
test below checks that its table and :data:`LAYERS` say the same):

    errors → config → arch → comm → collectives / mesh / pieces → model →
           parallel / optim / optimizers / checkpoint →
           train / ps / plan / bench / testing / viz → launch → cli

Every import of every module under ``src/plait`` is read with :mod:`ast` — ``import``
and ``from ... import`` statements anywhere (inside functions, under ``if
TYPE_CHECKING:``), relative ones resolved, and ``importlib.import_module("...")`` with a
constant name — and the target's layer is compared with the importer's. A module's layer
is the longest matching prefix in :data:`LAYERS`; the package root ``plait/__init__.py``
(whose lazy table may name anything) matches only itself.

Extra rules:

* The configuration package (``plait.config``) imports no torch, and inside it imports
  run one way (:data:`CONFIG_PARTS`): the rules (``plait.config.rules``: of plait, only
  errors and themselves), then the values (the sections, the allowed values, the root
  ``Config``), then reading and writing (dicts, TOML, overrides, help text, presets),
  which may import the values but not the other way round.
* ``plait.plan`` is pure arithmetic: it imports no torch and, of plait, only itself,
  errors, config and arch (no comm, mesh, testing, bench, model, parallel ...), so the
  planner runs where torch is not installed.
* ``plait.arch`` (the model's arithmetic, shared by ``plait.model`` and ``plait.plan``)
  imports no torch either.
* Only ``plait.comm`` imports ``torch.distributed``, besides the few modules in
  :data:`DISTRIBUTED_ALLOWED` that start or watch processes (each entry says why, and
  the test fails when an entry no longer needs the exception).
* Inside the planner, modules are in an order of their own (:data:`PLAN_ORDER`, the
  order ``plait/plan/__init__.py`` documents): a planner module imports only planner
  modules of its own level or earlier ones, and the planner's import graph has no cycle
  (imports inside functions count, so none can hide one).
* Checkpoint code (``plait.checkpoint``) imports nothing from ``plait.parallel``, though
  it shares its layer: it names no parallelism (each wrapper describes its own pieces).
* No two top-level sub-packages import each other.
* No module imports a private name (``from plait.x.y import _z``, or a private module
  ``plait.x._y``) from outside its own package: what another package may use is public,
  so a package can change its insides without breaking a caller it does not know of.

The checker is itself checked on synthetic sources, so it cannot pass vacuously.
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest

import plait

SRC = Path(plait.__file__).parent
"""The ``plait`` package directory (``src/plait``)."""

ROOT = "plait"

LAYERS: list[tuple[str, ...]] = [
    ("plait.errors",),
    ("plait.config",),
    ("plait.arch",),  # torch-free: the model's arithmetic, for plait.model and plait.plan
    ("plait.comm",),
    ("plait.collectives", "plait.mesh", "plait.pieces", "plait.host_scalar"),
    ("plait.model",),
    ("plait.parallel", "plait.optim", "plait.optimizers", "plait.checkpoint"),
    # viz sits beside train, as docs/architecture.md places it: the trainer draws its
    # measured pipeline timeline with plait.viz, and viz needs only errors and parallel.
    (
        "plait.train",
        "plait.data",
        "plait.ps",
        "plait.plan",
        "plait.bench",
        "plait.testing",
        "plait.viz",
    ),
    ("plait.launch",),
    ("plait.cli", "plait.__main__", ROOT),  # ROOT: the package's lazy table names anything
]
"""Layers, left to right; a module may import from its own layer and those to its left."""

DISTRIBUTED_ALLOWED: dict[str, str] = {
    # torchrun's elastic agent: the launcher starts and watches the worker processes
    "plait.launch.local": "starts ranks with torch.distributed.launcher.elastic_launch",
    "plait.launch.rendezvous_events": "names the elastic rendezvous' events without "
    "inspect.stack (a faster helper in torch.distributed.elastic's place)",
    # @record writes a failing rank's traceback where the elastic agent reports it
    "plait.cli.common": "wraps the rank commands' entry points in torch.distributed.elastic's "
    "@record",
}
"""Modules outside plait.comm allowed to import torch.distributed, and why."""

DISTRIBUTED = ("torch.distributed", "torch._C._distributed")
"""Import prefixes that talk to torch.distributed."""

PLAN = "plait.plan"
ARCH = "plait.arch"
"""The torch-free layer of model arithmetic that the model and the planner share."""
PLAN_MAY_IMPORT = (PLAN, *LAYERS[0], *LAYERS[1], ARCH)
"""What the pure-arithmetic planner may import from plait: itself, errors, config, arch."""
TORCH_FREE = (PLAN, ARCH, "plait.config")
"""Packages that import no torch (they run where torch is not installed)."""

CHECKPOINT = "plait.checkpoint"
"""Checkpoint code: it names no parallelism."""

CONFIG = "plait.config"
CONFIG_PARTS: list[tuple[str, ...]] = [
    ("plait.config.rules",),
    (CONFIG,),  # the values: one module per section, choices, root, the package itself
    (
        "plait.config.coerce",
        "plait.config.toml_io",
        "plait.config.overrides",
        "plait.config.help_text",
        "plait.config.presets",
    ),
]
"""The configuration package's inside, in import order: rules, values, reading and
writing; a module of ``plait.config`` imports (of plait) only errors and the parts up to
its own (longest prefix wins)."""

PLAN_ORDER: list[tuple[str, ...]] = [
    # the words: what is planned; an elastic run's replanning and checkpoint interval
    (
        "text",
        "hardware",
        "layout",
        "modelspec",
        "moe",
        "lora",
        "optimizer",
        "replan",
        "checkpoint_interval",
    ),
    ("profile_toml", "query"),  # the inputs: a hardware file, the query
    (  # the terms: activations, ZeRO units, links, compression, offload, kernels
        "activations",
        "units",
        "network",
        "compression",
        "offload_time",
        "offload",
        "activation_offload",
        "pipeline_zero",
        "overheads",
        "compute",
        "tp_comm",
        "dp_comm",
        "optimizer_time",
    ),
    ("memory",),  # a rank's memory
    ("estimate", "moe_estimate"),  # memory and step time of one layout
    ("evaluate", "space", "fit", "explain", "offload_check", "search", "moe_report"),
    ("report", "auto"),  # what the command line prints and --layout auto picks
    ("",),  # the package plait.plan itself (its __init__ names anything)
]
"""The planner's internal levels, earliest first: a module of ``plait.plan`` imports
only planner modules of its own level or earlier ones (and the graph has no cycle)."""


@dataclass(frozen=True)
class Import:
    """One import: where it is written and which module it loads."""

    file: str
    line: int
    target: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _is_under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int:
    """The layer index of a plait module (longest matching prefix; the root only itself)."""
    if module == ROOT:
        return len(LAYERS) - 1
    best, where = -1, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if name != ROOT and _is_under(module, name) and len(name) > best:
                best, where = len(name), i
    if where < 0:
        raise AssertionError(f"{module} is in no layer; add it to LAYERS in {__file__}")
    return where


def config_part(module: str) -> int:
    """The :data:`CONFIG_PARTS` index of a module of ``plait.config`` (longest prefix)."""
    best, where = -1, -1
    for i, names in enumerate(CONFIG_PARTS):
        for name in names:
            if _is_under(module, name) and len(name) > best:
                best, where = len(name), i
    return where


def describe_layer(i: int) -> str:
    """``layer 5 (plait.parallel, plait.optim)``."""
    return f"layer {i} ({', '.join(LAYERS[i])})"


def module_name(path: Path) -> str:
    """The dotted module name of a file under :data:`SRC`."""
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_plait_module(name: str) -> bool:
    """Whether ``plait.x.y`` names a module or package in the source tree."""
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    return (SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file()


def imports_of(source: str, module: str, is_package: bool, file: str = "<src>") -> list[Import]:
    """Every import a module's source makes, relative ones resolved.

    ``from A import b`` imports ``A`` and, when ``A.b`` is a module (``from plait import
    comm``, ``from torch import distributed``), ``A.b`` too. From the lazy root,
    ``from plait import comm`` loads only ``plait.comm``, while ``from plait import
    Trainer`` goes through the root package itself.
    """
    out: list[Import] = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [Import(file, node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                if node.level - 1 >= len(anchor):
                    raise AssertionError(f"{file}:{node.lineno}: relative import beyond plait")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            through_root = False
            for a in node.names:
                sub = f"{base}.{a.name}"
                submodule = _is_under(base, ROOT) and _is_plait_module(sub)
                if submodule or (base == "torch" and sub.startswith(DISTRIBUTED)):
                    out.append(Import(file, node.lineno, sub))
                elif base == ROOT:
                    through_root = True
            if base != ROOT or through_root:
                out.append(Import(file, node.lineno, base))
        elif (
            isinstance(node, ast.Call)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id == "__import__")
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append(Import(file, node.lineno, node.args[0].value))
    return out


def package_of(module: str, is_package: bool) -> str:
    """The package a module belongs to: itself for a package, else its parent."""
    return module if is_package else module.rpartition(".")[0]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(source: str, module: str, is_package: bool, file: str = "<src>") -> list[str]:
    """Each private name (or private module) a module imports from another package."""
    here = package_of(module, is_package)
    bad: list[str] = []
    for node in ast.walk(ast.parse(source)):
        names: list[tuple[str, str]] = []  # (module imported from, name)
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [(base, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            names = [(a.name.rpartition(".")[0], a.name.rpartition(".")[2]) for a in node.names]
        for base, name in names:
            if not _is_under(base, ROOT):
                continue
            owner = package_of(base, _is_plait_package(base))
            private_module = next((part for part in base.split(".") if _is_private(part)), None)
            what = name if _is_private(name) else private_module
            if what is not None and owner != here:
                bad.append(
                    f"{file}:{node.lineno}: {module} imports {what} from {base}: a private "
                    f"name of package {owner} (make it public there, or keep it inside)"
                )
    return bad


def _is_plait_package(name: str) -> bool:
    """Whether ``plait.x.y`` names a package (a folder with ``__init__.py``)."""
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    return (SRC / rel / "__init__.py").is_file()


def violations(
    source: str, module: str, is_package: bool = False, file: str = "<src>"
) -> list[str]:
    """Every rule a module's source breaks, one line each."""
    mine = layer_of(module)
    bad: list[str] = private_imports(source, module, is_package, file)
    for imp in imports_of(source, module, is_package, file):
        target = imp.target
        head = f"{imp.where}: {module} imports {target}"
        if target.startswith(DISTRIBUTED) and not (
            _is_under(module, "plait.comm") or module in DISTRIBUTED_ALLOWED
        ):
            bad.append(f"{head}: only plait.comm talks to torch.distributed")
        free = next((p for p in TORCH_FREE if _is_under(module, p)), None)
        if free is not None and _is_under(target, "torch"):
            bad.append(f"{head}: {free} imports no torch (it runs without torch)")
        if not _is_under(target, ROOT):
            continue
        if _is_under(module, CONFIG) and _is_under(target, CONFIG):
            mine_part, theirs_part = config_part(module), config_part(target)
            if theirs_part > mine_part:
                bad.append(
                    f"{head}: inside plait.config, {', '.join(CONFIG_PARTS[mine_part])} "
                    f"may not import from {', '.join(CONFIG_PARTS[theirs_part])}"
                )
        theirs = layer_of(target)
        if theirs > mine:
            bad.append(
                f"{head}: {describe_layer(mine)} may not import from {describe_layer(theirs)}"
            )
        if _is_under(module, PLAN) and not any(_is_under(target, p) for p in PLAN_MAY_IMPORT):
            bad.append(
                f"{head}: plait.plan is pure arithmetic; of plait it imports only "
                f"{', '.join(PLAN_MAY_IMPORT)}"
            )
        if _is_under(module, CHECKPOINT) and _is_under(target, "plait.parallel"):
            bad.append(f"{head}: checkpoint code names no parallelism (use local_pieces())")
    return bad


def _modules() -> list[tuple[Path, str]]:
    return [(p, module_name(p)) for p in sorted(SRC.rglob("*.py"))]


def _rel(path: Path) -> str:
    return str(path.relative_to(SRC.parent.parent if SRC.parent.name == "src" else SRC.parent))


def _all_imports() -> dict[str, list[Import]]:
    return {
        name: imports_of(p.read_text("utf-8"), name, p.name == "__init__.py", _rel(p))
        for p, name in _modules()
    }


def top_level(module: str) -> str:
    """The top-level sub-package or module a module belongs to (``plait.parallel``)."""
    return ".".join(module.split(".")[:2])


def package_cycles(imports: dict[str, list[Import]], packages: set[str] | None = None) -> list[str]:
    """Pairs of top-level sub-packages that import each other, with one witness import
    each way. ``packages`` (default: the directories under ``src/plait``) are the
    sub-packages; top-level modules (``mesh``, ``optim``) are left to the layer rules."""
    if packages is None:
        packages = {f"{ROOT}.{p.parent.name}" for p in SRC.glob("*/__init__.py")}
    edges: dict[tuple[str, str], Import] = {}
    for module, found in imports.items():
        for imp in found:
            a, b = top_level(module), top_level(imp.target)
            if a != b and a in packages and b in packages:
                edges.setdefault((a, b), imp)
    return sorted(
        f"{a} <-> {b}: {edges[a, b].where} imports {edges[a, b].target}; "
        f"{edges[b, a].where} imports {edges[b, a].target}"
        for a, b in edges
        if a < b and (b, a) in edges
    )


def plan_level(module: str, order: list[tuple[str, ...]] | None = None) -> int:
    """The level of a planner module (``plait.plan.x``) in :data:`PLAN_ORDER`."""
    order = PLAN_ORDER if order is None else order
    name = module.removeprefix(PLAN).removeprefix(".").partition(".")[0]
    for i, level in enumerate(order):
        if name in level:
            return i
    raise AssertionError(f"{module} is in no level of PLAN_ORDER; add it in {__file__}")


def plan_order_violations(
    imports: dict[str, list[Import]], order: list[tuple[str, ...]] | None = None
) -> list[str]:
    """Imports inside ``plait.plan`` that go to a later level, and every cycle of the
    planner's import graph (one line each, with the imports that close it)."""
    bad: list[str] = []
    edges: dict[str, dict[str, Import]] = {}
    for module, found in imports.items():
        if not _is_under(module, PLAN):
            continue
        for imp in found:
            if not _is_under(imp.target, PLAN) or imp.target == module:
                continue
            target = ".".join(imp.target.split(".")[:3])  # plait.plan.x (or plait.plan)
            edges.setdefault(module, {}).setdefault(target, imp)
            mine, theirs = plan_level(module, order), plan_level(target, order)
            if theirs > mine:
                bad.append(
                    f"{imp.where}: {module} (planner level {mine}) imports {target} (level "
                    f"{theirs}): a planner module imports only its own level or earlier ones"
                )
    done: set[str] = set()
    for start in sorted(edges):  # depth-first search for a path back to a visited module
        path: list[str] = []
        stack = [(start, iter(sorted(edges.get(start, {}))))]
        path.append(start)
        while stack:
            node, todo = stack[-1]
            nxt = next(todo, None)
            if nxt is None:
                stack.pop()
                path.pop()
                done.add(node)
            elif nxt in path:
                loop = [*path[path.index(nxt) :], nxt]
                witness = "; ".join(
                    f"{edges[a][b].where} imports {b}" for a, b in itertools.pairwise(loop)
                )
                bad.append(f"import cycle {' -> '.join(loop)}: {witness}")
            elif nxt not in done:
                path.append(nxt)
                stack.append((nxt, iter(sorted(edges.get(nxt, {})))))
    return sorted(set(bad))


# ------------------------------------------------------------------ the checker, checked


@pytest.mark.parametrize(
    ("source", "module", "why"),
    [
        (
            "from plait.train.trainer import Trainer\n",
            "plait.parallel.data_parallel",
            "may not import",
        ),
        ("def f():\n    from plait.parallel import zero\n", "plait.config", "may not import"),
        (
            "if TYPE_CHECKING:\n    from plait.checkpoint.state import TrainState\n",
            "plait.model.transformer",
            "may not import",
        ),
        ("from ..train import trainer\n", "plait.parallel.data_parallel", "may not import"),
        ("from .. import train\n", "plait.parallel.data_parallel", "may not import"),
        ("from plait import optim\n", "plait.model.transformer", "may not import"),
        ("from plait import Trainer\n", "plait.parallel.data_parallel", "may not import"),
        ("import plait.cli\n", "plait.launch.local", "may not import"),
        ("importlib.import_module('plait.train')\n", "plait.model", "may not import"),
        ("import torch\n", "plait.plan.search", "imports no torch"),
        ("from torch import nn\n", "plait.plan.search", "imports no torch"),
        ("import torch\n", "plait.arch.arithmetic", "imports no torch"),
        ("from plait.comm import all_reduce\n", "plait.arch", "may not import"),
        ("from plait.model import Transformer\n", "plait.arch.arithmetic", "may not import"),
        ("from plait.mesh import Mesh\n", "plait.plan.search", "pure arithmetic"),
        ("from plait.bench import calibrate\n", "plait.plan.fit", "pure arithmetic"),
        ("from plait import testing\n", "plait.plan.fit", "pure arithmetic"),
        ("import torch.distributed as dist\n", "plait.parallel.data_parallel", "torch.distributed"),
        ("from torch import distributed\n", "plait.train.trainer", "torch.distributed"),
        ("from torch.distributed import ReduceOp\n", "plait.mesh", "torch.distributed"),
        ("from plait.parallel.tensor import layers\n", "plait.checkpoint", "parallelism"),
        ("from plait.parallel import zero\n", "plait.checkpoint.format", "parallelism"),
        ("from plait.parallel.zero import flat\n", "plait.checkpoint.state", "parallelism"),
        ("from ..parallel import data_parallel\n", "plait.checkpoint.load", "parallelism"),
        ("from plait.train.faults import restart_count\n", "plait.checkpoint.manager", "may not"),
        ("from plait.train.trainer import Trainer\n", "plait.checkpoint", "may not import"),
        ("import torch\n", "plait.config.rules.layout", "plait.config imports no torch"),
        ("from torch import nn\n", "plait.config.parallel", "plait.config imports no torch"),
        ("from plait.config import choices\n", "plait.config.rules.choices", "inside"),
        ("from plait.config.root import Config\n", "plait.config.rules.layout", "inside"),
        ("from ..model import ModelConfig\n", "plait.config.rules.model", "inside"),
        ("from plait.config.toml_io import dump_toml\n", "plait.config.root", "inside"),
        ("from plait.config.presets import PRESETS\n", "plait.config.model", "inside"),
        ("from plait.config.coerce import sections\n", "plait.config", "inside"),
        ("from plait.comm import all_reduce\n", "plait.config.rules", "may not import"),
    ],
)
def test_the_checker_flags_what_it_should(source: str, module: str, why: str) -> None:
    found = violations(source, module, file="synthetic.py")
    assert found, f"{source!r} in {module} was not flagged"
    assert all(line.startswith("synthetic.py:") for line in found), found
    assert any(why in line for line in found), found


@pytest.mark.parametrize(
    ("source", "module"),
    [
        ("from plait.parallel.zero.reducer import _cap\n", "plait.parallel.pipeline.zero"),
        ("from ..zero.unit_reduction import _ALLOWED\n", "plait.parallel.pipeline.zero"),
        ("def f():\n    from plait.ps.core import _x\n", "plait.cli.ps"),
        ("from plait.comm import _private_module\n", "plait.parallel.data_parallel"),
        ("import plait.comm._wire\n", "plait.mesh"),
        ("from plait.parallel.zero import _helper\n", "plait.parallel"),  # parent -> child
    ],
)
def test_the_checker_flags_private_names_taken_across_packages(source: str, module: str) -> None:
    found = violations(source, module, file="synthetic.py")
    assert any("a private name of package" in line for line in found), found


def test_private_names_pass_inside_their_own_package() -> None:
    inside = "from plait.parallel.zero.unit_reduction import _ALLOWED\n"
    assert not private_imports(inside, "plait.parallel.zero.reducer", False)
    relative = "from .unit_reduction import _ALLOWED\n"
    assert not private_imports(relative, "plait.parallel.zero.x", False)
    assert not private_imports("from . import _x\n", "plait.parallel.zero", True)
    assert not private_imports("from plait.config import __all__\n", "plait.mesh", False)


def test_the_checker_lets_allowed_imports_pass() -> None:
    assert not violations("from plait.comm import all_reduce\nimport torch\n", "plait.mesh")
    assert not violations("from plait.parallel.zero import flat\n", "plait.parallel.data_parallel")
    assert not violations("from plait import comm\n", "plait.parallel.data_parallel")
    assert not violations("import torch.distributed as dist\n", "plait.comm.ops")
    assert not violations("from plait.config import Config\n", "plait.plan.layout")
    assert not violations("from plait.arch import param_count\n", "plait.plan.modelspec")
    assert not violations("from plait.arch import param_count\n", "plait.model.transformer")
    assert not violations("from plait.config import ModelConfig\n", "plait.arch.arithmetic")
    assert not violations("from .memory import x\n", "plait.plan.search")
    assert not violations("from plait.train import trainer\n", "plait.cli.train")
    assert not violations("from plait.train.trainer import Trainer\n", "plait")
    assert not violations("from plait.pieces import TPSplit\n", "plait.checkpoint.files")
    assert not violations("from plait.errors import ConfigError\n", "plait.config.rules.layout")
    assert not violations("from .choices import check_choice\n", "plait.config.rules.model")
    assert not violations("from plait.config.rules.layout import x\n", "plait.config.parallel")
    assert not violations("from plait.config.choices import Offload\n", "plait.config.root")
    assert not violations("from plait.config.root import Config\n", "plait.config.coerce")
    assert not violations("from plait.config.coerce import x\n", "plait.config.toml_io")
    assert not violations("from plait.config import ModelConfig\n", "plait.config.presets")


def test_the_checker_names_file_line_target_and_both_layers() -> None:
    (line,) = violations(
        "\n\nfrom plait.train.trainer import Trainer\n", "plait.model.transformer", file="m.py"
    )
    assert line.startswith("m.py:3: plait.model.transformer imports plait.train.trainer")
    assert describe_layer(layer_of("plait.model")) in line
    assert describe_layer(layer_of("plait.train")) in line


def test_every_layer_name_is_matched_by_longest_prefix_and_unknowns_are_refused() -> None:
    assert layer_of("plait.config.toml_io") == 1 and layer_of("plait.config") == 1
    assert layer_of("plait.arch.arithmetic") == 2
    assert layer_of("plait.comm.ops") == 3 and layer_of("plait.collectives.ring") == 4
    assert layer_of(ROOT) == len(LAYERS) - 1
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("plait.somewhere_new")  # not silently the root's layer


def test_the_cycle_finder_finds_a_cycle() -> None:
    synthetic = {
        "plait.train.trainer": [Import("a.py", 1, "plait.ps.server")],
        "plait.ps.server": [Import("b.py", 2, "plait.train.report")],
        "plait.parallel.data_parallel": [Import("c.py", 3, "plait.comm")],
    }
    (cycle,) = package_cycles(synthetic, {"plait.train", "plait.ps", "plait.parallel"})
    assert cycle.startswith("plait.ps <-> plait.train:")
    assert "a.py:1 imports plait.ps.server" in cycle and "b.py:2" in cycle


def test_the_plan_order_check_finds_an_upward_import_and_a_cycle() -> None:
    order = [("a", "b"), ("c",), ("",)]
    upward = {"plait.plan.a": [Import("a.py", 3, "plait.plan.c")]}
    (line,) = plan_order_violations(upward, order)
    assert line.startswith("a.py:3: plait.plan.a (planner level 0) imports plait.plan.c")
    cycle = {  # a -> b inside a function, b -> a at the top: same level, still a cycle
        "plait.plan.a": [Import("a.py", 9, "plait.plan.b")],
        "plait.plan.b": [Import("b.py", 2, "plait.plan.a")],
        "plait.plan.c": [Import("c.py", 1, "plait.plan.a"), Import("c.py", 2, "plait.comm")],
    }
    found = plan_order_violations(cycle, order)
    assert found and all(line.startswith("import cycle") for line in found), found
    assert any("a.py:9 imports plait.plan.b" in line and "b.py:2" in line for line in found)
    package = {"plait.plan.c": [Import("c.py", 4, "plait.plan")]}  # the package is last
    assert "imports plait.plan (level 2)" in plan_order_violations(package, order)[0]
    assert not plan_order_violations({"plait.plan.c": [Import("c.py", 1, "plait.plan.b")]}, order)
    with pytest.raises(AssertionError, match="no level"):
        plan_order_violations({"plait.plan.zz": [Import("z.py", 1, "plait.plan.a")]}, order)


def _plan_imports() -> dict[str, list[Import]]:
    return {
        name: imports_of(p.read_text("utf-8"), name, p.name == "__init__.py", _rel(p))
        for p, name in _modules()
        if _is_under(name, PLAN)
    }


def test_a_planted_cycle_in_the_real_planner_is_found() -> None:
    imports = _plan_imports()
    assert not plan_order_violations(imports)
    imports["plait.plan.layout"] = [
        *imports["plait.plan.layout"],
        Import("planted.py", 1, "plait.plan.search"),  # e.g. an import inside a function
    ]
    found = plan_order_violations(imports)
    assert any(line.startswith("planted.py:1: plait.plan.layout") for line in found), found
    assert any(line.startswith("import cycle") and "planted.py:1" in line for line in found)


# ------------------------------------------------------------------ the real tree


def test_the_planner_imports_in_its_declared_order_without_cycles() -> None:
    imports = _plan_imports()
    planner = list(imports)
    assert len(planner) > 20, "found too few planner modules"
    for module in planner:
        plan_level(module)  # every planner module has a declared level
    bad = plan_order_violations(imports)
    assert not bad, "the planner's internal order is broken:\n" + "\n".join(bad)


def test_imports_flow_one_way() -> None:
    modules = _modules()
    assert len(modules) > 60, "found too few modules: is SRC right?"
    bad = [
        v
        for path, name in modules
        for v in violations(path.read_text("utf-8"), name, path.name == "__init__.py", _rel(path))
    ]
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_every_module_of_the_config_package_is_in_a_part() -> None:
    """Each file of ``plait.config`` falls in the part it is meant to: the rules
    subpackage, one of the named reading/writing modules, or else the values (a new
    reading/writing module must be named in :data:`CONFIG_PARTS`, or it is a value)."""
    names = [name for _, name in _modules() if _is_under(name, CONFIG)]
    parts = {name: config_part(name) for name in names}
    assert {n for n, p in parts.items() if p == 0} == {
        n for n in names if _is_under(n, "plait.config.rules")
    }
    assert all(_is_plait_module(n) for n in CONFIG_PARTS[2]), CONFIG_PARTS[2]
    assert {"plait.config.root", "plait.config.parallel", CONFIG} <= {
        n for n, p in parts.items() if p == 1
    }


def test_the_torch_distributed_exceptions_are_still_needed() -> None:
    imports = _all_imports()
    stale = [
        m
        for m in DISTRIBUTED_ALLOWED
        if not any(i.target.startswith(DISTRIBUTED) for i in imports.get(m, []))
    ]
    assert not stale, f"remove from DISTRIBUTED_ALLOWED (no torch.distributed import): {stale}"


def test_no_two_subpackages_import_each_other() -> None:
    cycles = package_cycles(_all_imports())
    assert not cycles, "sub-packages that import each other:\n" + "\n".join(cycles)


# ------------------------------------------------------------------ the picture in the docs

ARCHITECTURE = SRC.parent.parent / "docs" / "architecture.md"
"""The page that draws the layers (docs/architecture.md, section "The picture")."""


def picture_rows(text: str) -> list[tuple[int, set[str], str]]:
    """(layer, packages, may-import text) for each row of the page's layer table."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            packages = {c.strip(" `") for c in cells[1].split(",")}
            rows.append((int(cells[0]), packages, cells[3]))
    return rows


def picture_disagreements(rows: list[tuple[int, set[str], str]]) -> list[str]:
    """Where the page's table and :data:`LAYERS` (and the extra rules) disagree."""
    bad = []
    if [r[0] for r in rows] != list(range(len(LAYERS))):
        bad.append(f"layers {[r[0] for r in rows]}, expected 0..{len(LAYERS) - 1}")
    for i, packages, may in rows:
        if i >= len(LAYERS):
            continue
        expected = set(LAYERS[i]) - {ROOT, "plait.__main__"}
        if packages != expected:
            bad.append(f"layer {i}: page names {sorted(packages)}, LAYERS {sorted(expected)}")
        scope = "nothing" if i == 0 else ("layer 0" if i == 1 else f"layers 0–{i - 1}")
        if not may.startswith(scope):
            bad.append(f"layer {i}: may import {may!r}, expected it to start with {scope!r}")
    rules = " ".join(r[2] for r in rows)
    rules_stated = (
        f"`{CHECKPOINT}` imports nothing from `plait.parallel`",
        "imports no torch",
        f"`{ARCH}` imports no torch",
    )
    for rule in rules_stated:
        if rule not in rules:
            bad.append(f"the page's table does not state the rule: {rule}")
    return bad


def test_the_architecture_page_draws_the_layers_the_test_enforces() -> None:
    rows = picture_rows(ARCHITECTURE.read_text("utf-8"))
    assert rows, f"no layer table found in {ARCHITECTURE}"
    assert not picture_disagreements(rows), picture_disagreements(rows)


def test_the_picture_check_finds_a_drifted_page() -> None:
    rows = picture_rows(ARCHITECTURE.read_text("utf-8"))
    moved = [(i, {"plait.train"} if i == 5 else p, m) for i, p, m in rows]
    assert any("layer 5" in line for line in picture_disagreements(moved))
    wrong_scope = [(i, p, "layers 0–7" if i == 2 else m) for i, p, m in rows]
    assert any("layer 2: may import" in line for line in picture_disagreements(wrong_scope))
    no_rule = [(i, p, m.replace("imports no torch", "")) for i, p, m in rows]
    assert any("imports no torch" in line for line in picture_disagreements(no_rule))
