"""Parallelism applied from outside to a model written for one device.

* :mod:`~plait.parallel.parallelize` — the recipe: :func:`parallelize` applies tensor,
  context and pipeline parallelism, recomputation and ZeRO / data parallelism in one
  fixed order.
* :mod:`~plait.parallel.model` — :class:`ParallelModel`, what the recipe returns: the
  wrapped module, its loss and the step driver, and the layout the optimizer and
  checkpoints read (norm groups, ``local_pieces()``).
* :mod:`~plait.parallel.loss` — the default loss (cross-entropy; vocabulary-parallel
  under tp: :mod:`~plait.parallel.tensor.loss`).
* :mod:`~plait.parallel.data_parallel`, :mod:`~plait.parallel.zero`,
  :mod:`~plait.parallel.tensor`, :mod:`~plait.parallel.context`,
  :mod:`~plait.parallel.pipeline`, :mod:`~plait.parallel.compression` — one folder or
  module per parallelism; :mod:`~plait.parallel.precision`,
  :mod:`~plait.parallel.recompute`, :mod:`~plait.parallel.checks`.

Nothing is imported here (import the module that defines a name, or use the lazy
names of :mod:`plait`): importing one parallelism does not import the others.
"""
