"""The table of families: every :class:`~plait.arch.spec.FamilySpec` plait loads and
every family it refuses by name (:data:`FAMILIES`, :data:`REFUSED`), and the lookups
the import and export use (:func:`family_of`, :func:`family_named`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plait.arch.families import (
    gemma,
    llama,
    mistral,
    mixtral,
    olmo2,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
from plait.arch.families.refused import REFUSED
from plait.arch.spec import FamilyError, FamilySpec, Refused

FAMILIES: dict[str, FamilySpec] = {
    s.name: s
    for s in (
        llama.SPEC,
        mistral.SPEC,
        qwen2.SPEC,
        qwen3.SPEC,
        phi3.SPEC,
        olmo2.SPEC,
        mixtral.SPEC,
        qwen2_moe.SPEC,
        qwen3_moe.SPEC,
        gemma.GEMMA2,
        gemma.GEMMA3,
    )
}
"""plait's short name (``model.arch``) -> the spec of each family plait loads."""

__all__ = [
    "FAMILIES",
    "REFUSED",
    "FamilyError",
    "FamilySpec",
    "Refused",
    "family_named",
    "family_of",
]


def supported_architectures() -> list[str]:
    """The ``architectures`` names plait loads."""
    return [s.architecture for s in FAMILIES.values()]


def family_of(hf: Mapping[str, Any], source: str) -> FamilySpec:
    """The spec of the ``config.json`` ``hf`` (by ``architectures[0]``, else
    ``model_type``); FamilyError naming the reason for a refused family and the
    supported ones for an unknown one."""
    archs = hf.get("architectures") or []
    arch = str(archs[0]) if archs else None
    kind = hf.get("model_type")
    for spec in FAMILIES.values():
        if arch == spec.architecture or (arch is None and kind == spec.model_type):
            return spec
    what = arch or f"model_type {kind!r}"
    for r in REFUSED:
        if arch == r.architecture or (arch is None and kind == r.model_type):
            raise FamilyError(
                f"{source}: architecture {what} is not supported ({r.reason}); plait loads "
                f"{', '.join(supported_architectures())}"
            )
    raise FamilyError(
        f"{source}: architecture {what} is not supported; plait loads "
        f"{', '.join(supported_architectures())} (plait models lists them)"
    )


def family_named(name: str) -> FamilySpec:
    """The spec of ``model.arch`` ``name`` (FamilyError naming the known ones)."""
    spec = FAMILIES.get(name)
    if spec is None:
        raise FamilyError(f"unknown model.arch {name!r}; one of {', '.join(FAMILIES)}")
    return spec
