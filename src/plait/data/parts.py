"""Which halves of a batch a rank reads: a pipeline's first stage needs only the inputs,
its last only the targets, a middle stage neither (issue 44).

A window set's ``batch(indices, parts)`` reads the tokens of the parts asked for (the
inputs are a window's first ``seq_len`` tokens, the targets its last ``seq_len``; both
are its ``seq_len + 1``) and gives an *absent* tensor for a part not asked for
(:func:`absent`): the right shape, so every rank's step sees the usual shapes, but no
storage beyond one element and no byte read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Parts:
    """The halves of a batch a rank reads."""

    inputs: bool = True
    """The windows' first ``seq_len`` tokens (the model's input)."""
    targets: bool = True
    """The windows' last ``seq_len`` tokens (the loss's targets, masks applied)."""

    def span(self, seq_len: int) -> tuple[int, int]:
        """``(lo, hi)``: the tokens of a window of ``seq_len + 1`` to read (``hi == lo``
        when neither part is wanted)."""
        if not (self.inputs or self.targets):
            return 0, 0
        return (0 if self.inputs else 1), (seq_len + 1 if self.targets else seq_len)


BOTH = Parts()
"""Inputs and targets: every rank without a pipeline."""


def absent(rows: int, seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A ``(rows, seq_len)`` int64 tensor standing for a part not read: zeros, one
    element of storage expanded (stride 0)."""
    return torch.zeros((), dtype=torch.long, device=device).expand(rows, seq_len)


def is_absent(t: torch.Tensor) -> bool:
    """Whether ``t`` is an :func:`absent` part (a 2-D tensor with zero strides)."""
    return t.dim() == 2 and t.numel() > 1 and t.stride() == (0, 0)


def split_window(
    rows: torch.Tensor, parts: Parts, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of ``(batch, hi - lo)`` rows read over :meth:`Parts.span`,
    an absent tensor for the part not wanted."""
    n = rows.shape[0]
    x = rows[:, :seq_len] if parts.inputs else absent(n, seq_len)
    y = rows[:, rows.shape[1] - seq_len :] if parts.targets else absent(n, seq_len)
    return x, y
