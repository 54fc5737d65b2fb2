"""Adam's moments in front of the sparsification: DGC's momentum correction in Adam's form.

Deep Gradient Compression (Lin et al. 2018) moves SGD's momentum in front of top-k:
each rank accumulates its own velocity and the sparsified quantity is what the optimizer
would apply, so an entry that waits K steps arrives with its K steps of update in full.
With Adam, error feedback on the raw gradient does not give that: Adam divides each
entry by the root of its running square, and an entry that arrives as one burst every
K = 1/rho steps is normalised by the burst and moves about sqrt(K) times less than in the
dense run (docs/compression.md).

The Adam form of the correction moves the whole of Adam in front: each rank keeps Adam's
first and second moments of **its own** gradient g_r (bias-corrected at step t)

    m_r <- b1 m_r + (1 - b1) g_r        v_r <- b2 v_r + (1 - b2) g_r**2
    u_r  = (m_r / (1 - b1**t)) / (sqrt(v_r / (1 - b2**t)) + eps)

and error feedback plus top-k act on u_r / N, the rank's share of the averaged update.
After the exchange every rank holds the same sum, mean_r(sent u_r), which a plain SGD
step (no momentum) applies as ``p <- p - lr * u``; SGD's coupled weight decay then equals
AdamW's decoupled one (``p <- p - lr * (u + wd * p)``). Entries arrive late but whole,
as in DGC for SGD. The moments are per-rank state, saved in each rank's checkpoint shard
with the error buffers. With rho = 1 this is Adam with per-rank moments, averaged: not
bit-equal to AdamW on the averaged gradient (the moments of a mean differ from the mean
of the moments), which is why ``parallel.compression_adam = "after"`` (error feedback on
the raw gradient, AdamW after the exchange) remains available.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LocalAdam:
    """Per-bucket Adam moments of this rank's own gradient.

    Args:
        beta1: the first moment's decay (``train.beta1``).
        beta2: the second moment's decay (``train.beta2``).
        eps: added to the root of the second moment (AdamW's default).
    """

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    exp_avg: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per bucket: ``(numel,)`` m_r, the first moment of this rank's gradient."""
    exp_avg_sq: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per bucket: ``(numel,)`` v_r, the second moment of this rank's gradient."""

    def __post_init__(self) -> None:
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0) or self.eps <= 0:
            raise ValueError(
                f"Adam's betas must be in [0, 1) and eps > 0, got "
                f"{self.beta1}, {self.beta2}, {self.eps}"
            )

    def update(self, key: int, grad: torch.Tensor, step: int) -> torch.Tensor:
        """Advance bucket ``key``'s moments by ``grad`` ``(numel,)`` (this rank's own
        gradient, not pre-divided) at 1-based optimizer step ``step``; return Adam's
        bias-corrected step direction u ``(numel,)`` (learning rate not applied)."""
        m = self.exp_avg.get(key)
        if m is None or m.shape != grad.shape:
            m = self.exp_avg[key] = torch.zeros_like(grad)
            self.exp_avg_sq[key] = torch.zeros_like(grad)
        v = self.exp_avg_sq[key]
        m.mul_(self.beta1).add_(grad, alpha=1.0 - self.beta1)
        v.mul_(self.beta2).addcmul_(grad, grad, value=1.0 - self.beta2)
        bc1 = 1.0 - self.beta1**step
        bc2 = 1.0 - self.beta2**step
        return (m / bc1) / ((v / bc2).sqrt_() + self.eps)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The moments as flat tensors (``adam_m/KEY``, ``adam_v/KEY``)."""
        out = {f"adam_m/{k}": t for k, t in self.exp_avg.items()}
        return out | {f"adam_v/{k}": t for k, t in self.exp_avg_sq.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`'s moments (copied); other keys are ignored."""
        self.exp_avg = _by_key(state, "adam_m/")
        self.exp_avg_sq = _by_key(state, "adam_v/")


def _by_key(state: dict[str, torch.Tensor], prefix: str) -> dict[int, torch.Tensor]:
    return {int(k[len(prefix) :]): v.clone() for k, v in state.items() if k.startswith(prefix)}
