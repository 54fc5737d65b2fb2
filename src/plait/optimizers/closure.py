"""``torch.optim.Optimizer.step``'s closure: re-evaluate the loss with gradients on."""

from __future__ import annotations

from collections.abc import Callable

import torch


def run_closure(closure: Callable[[], float] | None) -> float | None:
    """The loss ``closure`` returns (computed with gradients enabled), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
