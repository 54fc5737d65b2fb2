"""ZeRO / fully sharded data parallelism over the data-parallel axis.

* :mod:`~plait.parallel.zero.flat` — wrap units: parameters flattened, padded, sharded.
* :mod:`~plait.parallel.zero.reduce` — the gradient path inside backward: one
  reduction state machine per unit (``UnitReduction``), coordinated by ``GradientReducer``.
* :mod:`~plait.parallel.zero.bucket` — stages 1/2: units fused into reduce-scatter /
  all-gather buckets (``GradBucket``), the post-step all-gathers (``ParamSync``).
* :mod:`~plait.parallel.zero.gather` — stage 3's parameter path: one gather/free state
  machine per unit (``UnitGather``), coordinated by ``ParameterGatherer``.
* :mod:`~plait.parallel.zero.wrapper` — :class:`ZeroDataParallel`, stages 0-3.
* :mod:`~plait.parallel.zero.optim` — the sharded fp32 masters the optimizer steps.
"""

from plait.parallel.zero.wrapper import ZeroDataParallel

__all__ = ["ZeroDataParallel"]
