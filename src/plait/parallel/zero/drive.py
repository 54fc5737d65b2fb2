"""The ZeRO drive interface: what a driver sequences, and the two drivers to choose from.

A :class:`~plait.parallel.zero.ZeroDataParallel` owns driver-neutral state machines: its
flat units, their gradient reductions
(:class:`~plait.parallel.zero.reducer.GradientReducer`), stage 3's parameter gathers
(:class:`~plait.parallel.zero.gather.ParameterGatherer`) and stages 1/2's post-step
all-gathers. It hands them, as one :class:`ZeroDrive`, to exactly one driver, which says
*when* each moves; the driver is chosen once, when the wrapper is built
(``ZeroDataParallel(driver=...)``, which :func:`~plait.parallel.parallelize.parallelize`
sets from the layout):

* ``"autograd"`` (the default) — :class:`~plait.parallel.zero.driver.AutogradDriver`,
  built by the wrapper: hooks on the parameters and modules react to autograd;
* ``"schedule"`` (ZeRO-2/3 under pipeline parallelism) — no hook is installed; the
  pipeline engine is handed :attr:`ZeroDataParallel.drive
  <plait.parallel.zero.ZeroDataParallel.drive>` and
  :class:`~plait.parallel.pipeline.zero.PipelineZero` calls it around every compute
  action of the schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from plait.parallel.zero.flat import FlatUnit
from plait.parallel.zero.gather import ParameterGatherer
from plait.parallel.zero.reducer import GradientReducer

ZeroDriver = Literal["autograd", "schedule"]
"""Who sequences a wrapper's gathers and reductions: autograd hooks or a pipeline schedule."""
ZERO_DRIVERS: tuple[ZeroDriver, ...] = ("autograd", "schedule")
SCHEDULE_STAGES = (2, 3)
"""The ZeRO stages the pipeline schedule drives (stages 0/1 under pp keep autograd's)."""


@dataclass(frozen=True)
class ZeroDrive:
    """What one driver sequences for one ZeRO wrapper (the wrapper keeps the state)."""

    stage: int
    """The ZeRO stage (1-3; 0 replicates)."""
    units: list[FlatUnit]
    """The wrapper's flat units, in construction order (``unit.index``)."""
    reducer: GradientReducer
    """The units' gradient reductions (every stage)."""
    gatherer: ParameterGatherer | None
    """Stage 3: the units' parameter gathers; None below stage 3."""
    wait_params: Callable[[FlatUnit | None], None]
    """Stages 1/2: complete a unit's (None: every unit's) post-step all-gather; a no-op
    when none is in flight."""
