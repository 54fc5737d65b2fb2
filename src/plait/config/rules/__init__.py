"""Every rule of a run's configuration, once, as small functions on plain values.

Each function takes ints, strings and tuples (never a config object: this package
imports nothing of the value modules of :mod:`plait.config`, which call it) and raises
one :class:`~plait.errors.ConfigError` paragraph naming the numbers and what would work,
in one wording wherever the rule applies: the config's sections and
:meth:`plait.config.Config.validate` call these, and so do the constructors that need
the same rule (the mesh, the planner's layout, ``parallelize``, the ZeRO wrapper,
context parallelism). None needs torch. The checks owned by the layers above
(tensor-parallel divisibility, the pipeline schedule, the device's dtypes) are in
:func:`plait.parallel.checks.validate_run`.

One module per kind of rule, and each rule is imported from the one module that owns
it (this package re-exports nothing):

* :mod:`.choices`: the shared wording (``check_choice``, ``check_positive``,
  ``choice_error``);
* :mod:`.model`: the model's shape (MoE, RoPE scaling, sequence length, the
  tokenizer's vocabulary, a pretrained model's family);
* :mod:`.layout`: the parallel layout (world size, batch, pipeline, context and
  sequence parallelism, ZeRO's shard size, expert parallelism);
* :mod:`.schedule`: the learning-rate schedule (WSD's decay fits in the run);
* :mod:`.features`: features that need others (offload, compression, document masks,
  generation during training, step windows);
* :mod:`.activation_offload`: activation offloading's block count.
"""
