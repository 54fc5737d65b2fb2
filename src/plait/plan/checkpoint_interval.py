"""How often to checkpoint: Young's interval from the cost of a save and the time
between failures (no torch).

A save costs ``C`` seconds of training; a failure loses on average half an interval of
work (plus the restart). Young (1974) minimises the expected waste ``C / T + T / (2 M)``
over the interval ``T``: ``T = sqrt(2 C M)``, with ``M`` the mean time between failures
of the whole job. Daly (2006) refines it for ``C`` not small against ``M``
(:func:`daly_interval_s`); plait uses Young's, the first-order term of Daly's (they
differ by under 1 % while ``C < M / 1000``). Disk and in-memory checkpoints each get
their own interval from their own measured cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's optimal seconds between checkpoints: ``sqrt(2 · C · M)``."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order interval (2006): ``sqrt(2CM) · (1 + sqrt(C/2M)/3 + C/(18M)) -
    C`` while ``C < 2M``, else ``M``."""
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    r = save_s / (2.0 * mtbf_s)
    return young_interval_s(save_s, mtbf_s) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - save_s


@dataclass(frozen=True)
class Interval:
    """A checkpoint interval chosen by Young's rule."""

    kind: str
    """'disk' or 'memory'."""
    save_s: float
    """Measured seconds of one save (C)."""
    mtbf_s: float
    """Expected seconds between failures of the job (M)."""
    step_s: float
    """Measured seconds of one training step."""

    @property
    def seconds(self) -> float:
        """Young's interval in seconds."""
        return young_interval_s(self.save_s, self.mtbf_s)

    @property
    def steps(self) -> int:
        """The interval in whole steps (at least 1)."""
        return max(1, round(self.seconds / max(self.step_s, 1e-9)))

    @property
    def lost_s(self) -> float:
        """Expected training seconds lost per failure: half an interval of steps."""
        return 0.5 * self.steps * self.step_s

    def line(self) -> str:
        """One line for the run's start: the interval and what a failure costs."""
        return (
            f"plait: {self.kind} checkpoints every {self.steps} steps (Young: sqrt(2 x "
            f"{self.save_s:.3g} s save x {self.mtbf_s / 3600:.3g} h MTBF) = "
            f"{self.seconds:.0f} s at {self.step_s:.3g} s/step); expected loss per failure "
            f"{self.lost_s:.1f} s of training"
        )
