"""ZeRO / fully sharded data parallelism over the data-parallel axis.

* :mod:`~plait.parallel.zero.flat` — wrap units: parameters flattened, padded, sharded.
* :mod:`~plait.parallel.zero.unit_reduction` — one unit's gradient-reduction state
  machine (``UnitReduction``).
* :mod:`~plait.parallel.zero.reducer` — their coordinator, the gradient path: the units'
  reductions, the in-flight cap, the refusal of unused parameters (``GradientReducer``).
* :mod:`~plait.parallel.zero.bucket` — stages 1/2: units fused into reduce-scatter /
  all-gather buckets (``GradBucket``), the post-step all-gathers (``ParamSync``).
* :mod:`~plait.parallel.zero.gather` — stage 3's parameter path: one gather/free state
  machine per unit (``UnitGather``), coordinated by ``ParameterGatherer``.
* :mod:`~plait.parallel.zero.drive` — the drive interface (``ZeroDrive``: units, reducer,
  gatherer) and the two drivers a wrapper chooses from once, at construction.
* :mod:`~plait.parallel.zero.driver` — the autograd driver (``AutogradDriver``): hooks
  that say when units are gathered and reduced; the pipeline schedule is the other
  driver (:class:`plait.parallel.pipeline.zero.PipelineZero`, handed the ``ZeroDrive``).
* :mod:`~plait.parallel.zero.unit_by_unit` — stage 3 one unit at a time, no prefetch
  (``UnitByUnit``: generation never holds the whole model).
* :mod:`~plait.parallel.zero.wrapper` — :class:`ZeroDataParallel`, stages 0-3.
* :mod:`~plait.parallel.zero.optim` — the sharded fp32 masters the optimizer steps.
* :mod:`~plait.parallel.zero.experts` — expert parallelism: the expert weights' units
  over their replica group.
"""

from plait.parallel.zero.wrapper import ZeroDataParallel

__all__ = ["ZeroDataParallel"]
