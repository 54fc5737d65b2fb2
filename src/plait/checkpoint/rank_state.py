"""Per-rank state that is not a parameter piece: saved in each rank's own shard file.

Some state belongs to one rank and has no one-device meaning, such as a gradient
compressor's error-feedback buffers and PowerSGD's warm-start matrices
(:class:`plait.parallel.compression.Compressor`). It is saved under
``rank_state/<name>`` in the rank's shard and restored only onto the same rank of the
same layout; under another layout it starts afresh, with a warning (the run is still
correct, only the first compressed steps differ from an uninterrupted run).
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch

PREFIX = "rank_state/"


class HoldsRankState(Protocol):
    """An object with per-rank tensors to save (a gradient compressor)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The state, as named tensors."""
        ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`'s values."""
        ...


def rank_state_tensors(holder: HoldsRankState | None) -> dict[str, torch.Tensor]:
    """The shard-file entries of ``holder``'s state (none when there is no holder)."""
    if holder is None:
        return {}
    return {PREFIX + k: v.detach().to("cpu", copy=True) for k, v in holder.state_dict().items()}


def restore_rank_state(
    holder: HoldsRankState | None,
    meta: dict[str, Any],
    rank: int,
    read: Any,
) -> bool:
    """Load this rank's saved state into ``holder`` when the checkpoint has it for the
    same rank of the same world size; ``read(file, key)`` returns a stored tensor.
    Returns whether it was restored."""
    if holder is None:
        return False
    ranks = meta["ranks"]
    saved = ranks[rank] if rank < len(ranks) else None
    keys = [k for k in (saved or {}).get("keys", []) if k.startswith(PREFIX)]
    if len(ranks) != meta["layout"]["world_size"] or not keys or saved is None:
        warnings.warn(
            "the checkpoint holds no gradient-compression state for this rank and layout; "
            "error feedback starts from zero",
            stacklevel=2,
        )
        return False
    holder.load_state_dict({k[len(PREFIX) :]: read(saved["file"], k) for k in keys})
    return True
