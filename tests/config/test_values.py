"""Each allowed-value set is declared once, in :mod:`plait.config.choices` (a ``Literal``
type and the tuple derived from it; :mod:`plait.config` re-exports the ones other
packages use), and every other module imports it. (That the rules in
:mod:`plait.config.rules` import nothing of the value modules is checked with the rest of
the configuration package's inside order, in ``tests/test_layers.py``.) No torch."""

from __future__ import annotations

import ast
import typing
from collections.abc import Iterator
from pathlib import Path

import plait
from plait import config
from plait.config import choices
from plait.plan import space
from plait.plan.layout import Layout

SRC = Path(plait.__file__).parent
CHOICES = SRC / "config" / "choices.py"
"""The one module that spells the allowed-value sets out."""


def _value_sets() -> dict[str, tuple[object, ...]]:
    """Every allowed-value set :mod:`plait.config.choices` declares (its Literal types)."""
    sets = {
        name: typing.get_args(value)
        for name, value in vars(choices).items()
        if typing.get_origin(value) is typing.Literal
    }
    sets["ZERO_STAGES"] = choices.ZERO_STAGES
    return sets


def _spelled_sets(tree: ast.AST) -> Iterator[frozenset[object]]:
    """The value sets written out in code: ``Literal[...]`` and tuples of constants."""
    for node in ast.walk(tree):
        elts: list[ast.expr] | None = None
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", "") == "Literal":
            elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        elif isinstance(node, ast.Tuple):
            elts = node.elts
        if elts and all(isinstance(e, ast.Constant) for e in elts):
            yield frozenset(e.value for e in elts if isinstance(e, ast.Constant))


def test_each_allowed_value_set_is_declared_once() -> None:
    """No module but plait.config.choices writes one of its sets out again (as a Literal
    or a tuple, in any order), not even the package's section modules; the others import
    it (docstrings may name the values)."""
    sets = {frozenset(values): name for name, values in _value_sets().items()}
    again = sorted(
        f"{path.relative_to(SRC)}: {sets[found]}"
        for path in SRC.rglob("*.py")
        if path != CHOICES
        for found in set(_spelled_sets(ast.parse(path.read_text())))
        if found in sets
    )
    assert not again, f"allowed values declared again (import them from plait.config): {again}"


def test_the_value_tuples_come_from_the_literals() -> None:
    pairs = [
        (config.RECOMPUTES, config.Recompute),
        (config.PIPELINE_SCHEDULES, choices.PipelineSchedule),
        (config.PLANNED_SCHEDULES, config.PlannedSchedule),
        (config.OFFLOADS, config.Offload),
        (config.CP_ATTENTIONS, config.CPAttention),
        (config.PP_GRAD_REDUCES, config.PPGradReduce),
        (config.COMPRESSIONS, config.Compression),
    ]
    for values, literal in pairs:
        assert values == typing.get_args(literal)
    assert set(config.PLANNED_SCHEDULES) <= set(config.PIPELINE_SCHEDULES)


def test_the_planners_layout_uses_the_configs_types() -> None:
    hints = typing.get_type_hints(Layout)
    assert hints["recompute"] is config.Recompute
    assert hints["schedule"] is config.PlannedSchedule
    assert hints["cp_attention"] is config.CPAttention
    assert hints["pp_grad_reduce"] is config.PPGradReduce
    assert hints["compression"] is config.Compression
    assert space.Space().recompute is config.RECOMPUTES
    assert space.Space().zero is config.ZERO_STAGES


def test_the_choices_module_declares_every_set() -> None:
    """The choices module spells each of its sets out (so the test above exempts the
    right file), and what plait.config re-exports of them is the same object."""
    spelled = set(_spelled_sets(ast.parse(CHOICES.read_text())))
    for name, values in _value_sets().items():
        assert frozenset(values) in spelled, name
    exported = [n for n in config.__all__ if hasattr(choices, n)]
    assert len(exported) > 10  # the sets other packages import from plait.config
    for name in exported:
        assert getattr(config, name) is getattr(choices, name), name
