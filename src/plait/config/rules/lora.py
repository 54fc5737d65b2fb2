"""Rules on LoRA adapters (``[lora]``): the rank, the scale, the dropout, the targets.

See :mod:`plait.config.rules`.
"""

from __future__ import annotations

from plait.errors import ConfigError

LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "q": ("wq", "q_proj"),
    "k": ("wk", "k_proj"),
    "v": ("wv", "v_proj"),
    "o": ("wo", "o_proj"),
    "gate": ("w1", "gate_proj"),
    "up": ("w3", "up_proj"),
    "down": ("w2", "down_proj"),
}
"""Each LoRA target's short name -> the last component of the linear layers it names
(plait's built-in transformer, then the Hugging Face Llama classes')."""


def parse_lora_targets(targets: str) -> tuple[str, ...]:
    """``"q,k,v"`` -> ``("q", "k", "v")``; refuses an empty list, a repeated name and a
    name that is not one of :data:`LORA_TARGETS`."""
    names = tuple(t.strip() for t in targets.split(",") if t.strip())
    if not names:
        raise ConfigError(
            f"lora.targets is empty; name some of {', '.join(LORA_TARGETS)} (comma-separated)."
        )
    for n in names:
        if n not in LORA_TARGETS:
            raise ConfigError(
                f"lora.targets: {n!r} matches no layer of the model; the targets are "
                f"{', '.join(LORA_TARGETS)} (comma-separated)."
            )
    if len(set(names)) != len(names):
        raise ConfigError(f"lora.targets names a layer twice: {targets!r}.")
    return names


def check_lora(rank: int | None, alpha: float, dropout: float) -> None:
    """A LoRA rank (None: LoRA off) must be >= 1, the scale's alpha > 0 and the dropout
    probability in [0, 1)."""
    if rank is not None and rank <= 0:
        raise ConfigError(f"lora.rank must be >= 1 (the adapters' inner dimension), got {rank}.")
    if not alpha > 0:
        raise ConfigError(f"lora.alpha must be > 0 (the scale is alpha / rank), got {alpha}.")
    if not 0 <= dropout < 1:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {dropout}.")
