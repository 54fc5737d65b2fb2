"""LoRA as the planner sees it: which layers carry adapters and of what rank.

With LoRA the base model is frozen: a rank holds its share of the base weights (in the
compute dtype: no gradients, no fp32 master, no optimizer state) plus the adapters,
which alone are trained, reduced and (under ZeRO) sharded, in one flat unit per block
(:func:`plait.plan.units.lora_unit`; :func:`plait.plan.memory.stage_memory` counts both).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.config.rules.lora import parse_lora_targets

COLUMN_TARGETS = ("q", "k", "v", "gate", "up")
"""Targets whose base layer is column-parallel: B split over tp, A replicated."""

ROW_TARGETS = ("o", "down")
"""Targets whose base layer is row-parallel: A split over tp, B replicated."""

MODULE_ORDER = ("q", "k", "v", "o", "gate", "up", "down")
"""The targets in the order a block registers their layers (wq, wk, wv, wo, w1, w3,
w2): the order ZeRO flattens the adapters in."""


@dataclass(frozen=True)
class LoraSpec:
    """Adapters of rank ``rank`` on the layers ``targets`` names (comma-separated short
    names, as ``lora.targets``)."""

    rank: int
    targets: str = "q,k,v,o,gate,up,down"

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        parse_lora_targets(self.targets)

    @property
    def ordered(self) -> tuple[str, ...]:
        """The targets in module order."""
        chosen = set(parse_lora_targets(self.targets))
        return tuple(t for t in MODULE_ORDER if t in chosen)
