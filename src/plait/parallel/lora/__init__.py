"""LoRA: low-rank adapters on a frozen base, under every layout (docs/fine-tuning.md).

:func:`~plait.parallel.lora.apply.apply_lora` freezes a model and attaches the adapters
(``parallelize`` calls it after tensor parallelism); :mod:`plait.parallel.lora.branch`
says how an adapter attaches to a plain or tensor-parallel linear layer and which
factor is split or replicated.
"""

from plait.parallel.lora.apply import (
    LoraApplied,
    LoraValues,
    adapter_parameters,
    apply_lora,
    lora_layers,
)
from plait.parallel.lora.branch import LoraBranch

__all__ = [
    "LoraApplied",
    "LoraBranch",
    "LoraValues",
    "adapter_parameters",
    "apply_lora",
    "lora_layers",
]
