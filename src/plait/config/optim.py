"""The optimizer section (``[optim]``): Muon's and Adafactor's hyper-parameters.

``train.optimizer`` picks the optimizer; AdamW's keys stay in ``[train]`` (``lr``,
``weight_decay``, ``beta1``, ``beta2``): AdamW also steps the parameters Muon does not
(embeddings, output head, norms, biases). Muon's keys are ``torch.optim.Muon``'s names
and defaults with a ``muon_`` prefix. See docs/optimizers.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.config.choices import MuonLrAdjust, NSDType, check_choices
from plait.config.rules.choices import check_positive
from plait.errors import ConfigError


@dataclass
class OptimConfig:
    """Hyper-parameters of the matrix optimizers (``train.optimizer``)."""

    muon_lr: float = 1e-3
    """Muon's peak learning rate (torch.optim.Muon's default); it follows train.lr's
    schedule: at each step it is muon_lr · (the scheduled lr / the peak lr)."""
    muon_weight_decay: float = 0.1
    """Muon's decoupled weight decay: p <- p · (1 - lr · muon_weight_decay)."""
    muon_momentum: float = 0.95
    """Muon's momentum (an exponential average of the gradients)."""
    muon_nesterov: bool = True
    """Nesterov momentum: orthogonalise g + momentum · (B - g) instead of B."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per step (fewer than 100)."""
    muon_ns_a: float = 3.4445
    """Newton-Schulz coefficient a (torch.optim.Muon's ns_coefficients[0])."""
    muon_ns_b: float = -4.7750
    """Newton-Schulz coefficient b."""
    muon_ns_c: float = 2.0315
    """Newton-Schulz coefficient c."""
    muon_eps: float = 1e-7
    """Floor of the norm the matrix is divided by before the iteration."""
    muon_lr_adjust: MuonLrAdjust = "original"
    """Per-matrix learning rate: 'original' lr · sqrt(max(1, out/in)) (Keller Jordan's),
    'match_rms_adamw' lr · 0.2 · sqrt(max(out, in)) (Moonlight's: reuse AdamW's lr)."""
    muon_ns_dtype: NSDType = "bfloat16"
    """Dtype of the Newton-Schulz iteration: 'bfloat16' (PyTorch's), 'float32',
    'float64' (exact comparisons between layouts)."""
    adafactor_beta2_decay: float = -0.8
    """Adafactor: the second-moment decay exponent (beta2_t = 1 - t^beta2_decay)."""
    adafactor_d: float = 1.0
    """Adafactor: the clipping threshold of the update's RMS."""
    adafactor_weight_decay: float = 0.0
    """Adafactor: decoupled weight decay (torch.optim.Adafactor's default 0)."""

    def __post_init__(self) -> None:
        check_choices(self, "optim.")
        check_positive("optim.", muon_lr=self.muon_lr, muon_ns_steps=self.muon_ns_steps)
        if not self.muon_ns_steps < 100:
            raise ConfigError(f"optim.muon_ns_steps must be < 100, got {self.muon_ns_steps}.")
        if self.muon_weight_decay < 0 or self.adafactor_weight_decay < 0 or self.muon_eps < 0:
            raise ConfigError(
                "optim.muon_weight_decay, optim.muon_eps and optim.adafactor_weight_decay "
                "must not be negative."
            )
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(f"optim.muon_momentum must be in [0, 1), got {self.muon_momentum}.")
        if self.adafactor_beta2_decay > 0 or self.adafactor_d < 1.0:
            raise ConfigError(
                "optim.adafactor_beta2_decay must be <= 0 and optim.adafactor_d >= 1 "
                f"(got {self.adafactor_beta2_decay}, {self.adafactor_d})."
            )
