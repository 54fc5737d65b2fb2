"""Every rule of a run's configuration, once, as small functions on plain values.

Each function takes ints, strings and tuples (never a config object: this module
imports nothing of :mod:`plait.config`, which calls it) and raises one
:class:`ConfigError` paragraph naming the numbers and what would work, in one wording
wherever the rule applies: the config's sections and :meth:`plait.config.Config.validate`
call these, and so do the constructors that need the same rule (the mesh, the planner's
layout, ``parallelize``, the ZeRO wrapper, context parallelism). None needs torch. The
checks owned by the layers above (tensor-parallel divisibility, the pipeline schedule,
the device's dtypes) are in :func:`plait.parallel.checks.validate_run`.

One module per kind of rule: :mod:`.choices` (the shared wording), :mod:`.model`,
:mod:`.layout` and :mod:`.features`; every rule is importable from here.
"""

from __future__ import annotations

from plait.config_checks.choices import (
    check_choice,
    check_positive,
    choice_error,
)
from plait.config_checks.features import (
    OFFLOAD_RING_BUFFERS,
    check_compression,
    check_compression_warmup,
    check_document_mask,
    check_generation_layout,
    check_offload,
    check_offload_dir,
    check_sample_length,
    parse_step_window,
)
from plait.config_checks.layout import (
    check_batch,
    check_chunks,
    check_cp_sequence,
    check_expert_parallel,
    check_interleaved,
    check_pipeline,
    check_pp_reshard,
    check_shard_size,
    check_sp_under_cp,
    check_ulysses_heads,
    check_world,
)
from plait.config_checks.model import (
    check_moe,
    check_pretrained_model,
    check_rope_scaling,
    check_seq_len,
    check_tokenizer_vocab,
)

__all__ = [
    "OFFLOAD_RING_BUFFERS",
    "check_batch",
    "check_choice",
    "check_chunks",
    "check_compression",
    "check_compression_warmup",
    "check_cp_sequence",
    "check_document_mask",
    "check_expert_parallel",
    "check_generation_layout",
    "check_interleaved",
    "check_moe",
    "check_offload",
    "check_offload_dir",
    "check_pipeline",
    "check_positive",
    "check_pp_reshard",
    "check_pretrained_model",
    "check_rope_scaling",
    "check_sample_length",
    "check_seq_len",
    "check_shard_size",
    "check_sp_under_cp",
    "check_tokenizer_vocab",
    "check_ulysses_heads",
    "check_world",
    "choice_error",
    "parse_step_window",
]
