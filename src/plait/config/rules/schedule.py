"""The learning-rate schedule's rules (``train.lr_schedule`` and its WSD fields).

See :mod:`plait.config.rules` and :mod:`plait.train.lr_schedule`.
"""

from __future__ import annotations

import math

from plait.errors import ConfigError


def wsd_decay_steps(steps: int, fraction: float) -> int:
    """The steps WSD spends decaying: ``ceil(fraction · steps)`` (at least 1)."""
    return max(1, math.ceil(fraction * steps - 1e-9))


def check_lr_schedule(schedule: str, steps: int, warmup: int, fraction: float) -> None:
    """``train.lr_decay_fraction`` is in (0, 1]; under 'wsd' the warm-up and the decay
    fit in the run without overlapping."""
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"train.lr_decay_fraction must be in (0, 1], got {fraction}.")
    if schedule != "wsd":
        return
    decay = wsd_decay_steps(steps, fraction)
    if warmup + decay > steps:
        raise ConfigError(
            f"train.lr_schedule 'wsd': {warmup} warm-up step(s) and {decay} decay step(s) "
            f"(train.lr_decay_fraction {fraction} of {steps}) do not fit in train.steps "
            f"{steps}; use fewer train.warmup_steps or a smaller train.lr_decay_fraction."
        )
