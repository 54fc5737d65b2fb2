"""The written-out local Adam that the top-k reference tests share: each rank's update
direction from its own gradients (betas 0.9 / 0.95, eps 1e-8, bias-corrected), float64."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def local_adam_updates(grads: list[torch.Tensor], n: int) -> Iterator[torch.Tensor]:
    """Per step, ``u / n``: Adam's bias-corrected m / (sqrt(v) + eps) of this rank's
    gradients ``(numel,)``, divided by the ``n`` ranks that will sum it."""
    m = torch.zeros_like(grads[0], dtype=torch.float64)
    v = torch.zeros_like(grads[0], dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        m = 0.9 * m + 0.1 * g
        v = 0.95 * v + 0.05 * g * g
        yield (m / (1 - 0.9**t)) / ((v / (1 - 0.95**t)).sqrt() + 1e-8) / n
