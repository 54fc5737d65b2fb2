"""Megatron tensor parallelism and sequence parallelism over the tp axis.

* :mod:`~plait.parallel.tensor.layers` — column/row-parallel linear, vocabulary-parallel
  embedding, and the :class:`TPShard` layout every sharded parameter carries.
* :mod:`~plait.parallel.tensor.loss` — vocabulary-parallel cross-entropy.
* :mod:`~plait.parallel.tensor.sequence` — sequence-parallel region entry and exit.
* :mod:`~plait.parallel.tensor.sharding_plan` — sharding plans as data and
  :func:`apply_tensor_parallel`.
"""
