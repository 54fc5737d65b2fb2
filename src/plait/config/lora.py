"""The LoRA section (``[lora]``): low-rank adapters trained on a frozen base model."""

from __future__ import annotations

from dataclasses import dataclass

from plait.config.rules.lora import check_lora, parse_lora_targets


@dataclass
class LoraConfig:
    """Low-rank adapters (Hu et al. 2021) with PEFT's semantics: each targeted linear
    layer computes ``W x + (alpha / rank) · B A dropout(x)``; ``W`` (and every other
    weight of the model) is frozen, ``A`` starts as PEFT's Kaiming-uniform draw and ``B``
    at zero. See docs/fine-tuning.md (LoRA)."""

    rank: int | None = None
    """The adapters' rank r (None: LoRA off; the whole model is trained)."""
    alpha: float = 16.0
    """The scale's numerator: the adapter's output is multiplied by alpha / rank."""
    targets: str = "q,k,v,o,gate,up,down"
    """The linear layers that get adapters, comma-separated: q, k, v, o (attention
    projections), gate, up, down (feed-forward)."""
    dropout: float = 0.0
    """Dropout probability on the adapter's input (PEFT's lora_dropout)."""
    init_from: str | None = None
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to
    continue from: its rank, alpha and targets must equal these. ``train.init_from``
    stays the base model."""

    def __post_init__(self) -> None:
        check_lora(self.rank, self.alpha, self.dropout)
        parse_lora_targets(self.targets)

    @property
    def enabled(self) -> bool:
        """Whether LoRA is on (a rank is set)."""
        return self.rank is not None

    @property
    def target_names(self) -> tuple[str, ...]:
        """The targets as a tuple of short names."""
        return parse_lora_targets(self.targets)

    @property
    def scale(self) -> float:
        """alpha / rank (1.0 while LoRA is off)."""
        return self.alpha / self.rank if self.rank else 1.0
