"""The learning rate of each optimizer step: warm-up, then the run's schedule.

Every schedule starts with ``train.warmup_steps`` steps of linear warm-up to the peak
``lr`` (``train.effective_lr()``: after the linear scaling rule, if on): step ``s`` of
the warm-up has ``peak · (s + 1) / warmup``. After it, with ``low = peak ·
min_lr_ratio``, ``W`` the warm-up steps and ``S`` ``train.steps``:

* ``cosine``: ``low + (peak - low) · (1 + cos(π·x)) / 2``, ``x = (s - W) / (S - W)``;
* ``linear``: ``low + (peak - low) · (1 - x)``, the same ``x``;
* ``constant``: ``peak``;
* ``wsd`` (warm-up, stable, decay; Hu et al. 2024, MiniCPM; Hägele et al. 2024, "Scaling
  Laws and Compute-Optimal Training Beyond Fixed Training Durations"): ``peak`` until
  the last ``D = ceil(lr_decay_fraction · S)`` steps, then ``low + (peak - low) ·
  f(x)``, ``x = (s - (S - D)) / D``, with ``f`` of ``train.lr_decay_shape``:
  ``linear`` ``1 - x``, ``cosine`` ``(1 + cos(π·x)) / 2``, ``1-sqrt`` ``1 - sqrt(x)``
  (the cooldown Hägele et al. find best).

``x`` is capped at 1. The rate is a function of the step alone (the trainer's applied
steps, saved in checkpoints), so a resumed run continues the schedule where it stopped.
"""

from __future__ import annotations

import math

from plait.config import Config
from plait.config.rules.schedule import wsd_decay_steps


def decay_factor(shape: str, x: float) -> float:
    """The fraction of ``peak - low`` left at decay progress ``x`` in [0, 1]."""
    x = min(1.0, max(0.0, x))
    if shape == "linear":
        return 1.0 - x
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * x))
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(x)
    raise ValueError(f"unknown decay shape {shape!r}")


def lr_at(step: int, cfg: Config) -> float:
    """Learning rate for optimizer step ``step`` (0-based) under ``cfg.train``'s schedule
    (see the module docstring)."""
    t = cfg.train
    peak = t.effective_lr()
    if step < t.warmup_steps:
        return peak * (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return peak
    low = peak * t.min_lr_ratio
    if t.lr_schedule == "wsd":
        decay = wsd_decay_steps(t.steps, t.lr_decay_fraction)
        start = t.steps - decay
        if step < start:
            return peak
        return low + (peak - low) * decay_factor(t.lr_decay_shape, (step - start) / decay)
    x = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    shape = "linear" if t.lr_schedule == "linear" else "cosine"
    return low + (peak - low) * decay_factor(shape, x)


def schedule_note(cfg: Config) -> str:
    """The schedule in a few words, for the banner."""
    t = cfg.train
    warm = f"{t.warmup_steps} warm-up step(s), then "
    if t.lr_schedule == "constant":
        return warm + "constant"
    if t.lr_schedule == "wsd":
        decay = wsd_decay_steps(t.steps, t.lr_decay_fraction)
        return (
            warm + f"wsd: stable until step {t.steps - decay}, {t.lr_decay_shape} decay over "
            f"{decay} step(s) to x{t.min_lr_ratio}"
        )
    return warm + f"{t.lr_schedule} decay to x{t.min_lr_ratio}"
