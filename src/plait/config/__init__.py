"""Typed configuration for a plait run.

Every field has a docstring (the string literal under it); `plait train --help-config`
prints them. Each dataclass validates its own fields in ``__post_init__``; checks that
need several sections (the layout against the world size, the global batch against
the layout) run in :meth:`Config.validate`, before any process starts. The rules
themselves are written once, as functions on plain values, in :mod:`plait.config_checks`
(which imports nothing from here); the constructors that need a rule call the same one.

Each set of allowed values (pipeline schedules, recompute policies, offload kinds, ...)
is declared once, as a ``Literal`` type in :mod:`plait.config.choices`; the tuple of its
values is derived from it (``typing.get_args``) and every other module imports both from
here.

The **global batch** (``train.global_batch``, in sequences) is the invariant of a run:
the per-rank micro-batch and the number of accumulation steps are derived from it and
the data-parallel degree, so changing the layout never changes the math.

One module per section, in section order: :mod:`~plait.config.model`,
:mod:`~plait.config.parallel`, :mod:`~plait.config.train`,
:mod:`~plait.config.precision`, :mod:`~plait.config.data`, :mod:`~plait.config.log`,
:mod:`~plait.config.launch`; the root :class:`Config` in :mod:`~plait.config.root`.
Import every name from ``plait.config``.
"""

from __future__ import annotations

from plait.config.choices import (
    COMPRESSION_ADAMS,
    COMPRESSIONS,
    CP_ATTENTIONS,
    NONFINITES,
    OFFLOADS,
    PIPELINE_SCHEDULES,
    PLANNED_SCHEDULES,
    PP_GRAD_REDUCES,
    PRESET_STYLES,
    RECOMPUTES,
    TOKEN_DTYPES,
    TOPK_SCOPES,
    ZERO_MEANING,
    ZERO_STAGES,
    AttentionKind,
    Backend,
    Balance,
    Compression,
    CompressionAdam,
    CPAttention,
    Device,
    DType,
    LaunchBackend,
    ModelFamily,
    MoERouter,
    NonFinite,
    Offload,
    PipelineSchedule,
    PlannedSchedule,
    PPGradReduce,
    PresetStyle,
    Progress,
    Recompute,
    ReduceDType,
    RopeScaling,
    TokenDType,
    TopKScope,
    WandbMode,
    check_choices,
)
from plait.config.data import DataConfig
from plait.config.launch import LaunchConfig
from plait.config.log import LogConfig
from plait.config.model import ModelConfig
from plait.config.parallel import ParallelConfig
from plait.config.precision import PrecisionConfig
from plait.config.root import Config
from plait.config.train import TrainConfig
from plait.config_checks import (
    check_batch,
    check_choice,
    check_compression,
    check_compression_warmup,
    check_cp_sequence,
    check_document_mask,
    check_expert_parallel,
    check_generation_layout,
    check_moe,
    check_offload,
    check_pipeline,
    check_positive,
    check_pp_reshard,
    check_rope_scaling,
    check_sample_length,
    check_seq_len,
    check_shard_size,
    check_sp_under_cp,
    check_tokenizer_vocab,
    check_ulysses_heads,
    check_world,
    parse_step_window,
)
from plait.errors import ConfigError

__all__ = [
    "COMPRESSIONS",
    "COMPRESSION_ADAMS",
    "CP_ATTENTIONS",
    "NONFINITES",
    "OFFLOADS",
    "PIPELINE_SCHEDULES",
    "PLANNED_SCHEDULES",
    "PP_GRAD_REDUCES",
    "PRESET_STYLES",
    "RECOMPUTES",
    "TOKEN_DTYPES",
    "TOPK_SCOPES",
    "ZERO_MEANING",
    "ZERO_STAGES",
    "AttentionKind",
    "Backend",
    "Balance",
    "CPAttention",
    "Compression",
    "CompressionAdam",
    "Config",
    "ConfigError",
    "DType",
    "DataConfig",
    "Device",
    "LaunchBackend",
    "LaunchConfig",
    "LogConfig",
    "MoERouter",
    "ModelConfig",
    "ModelFamily",
    "NonFinite",
    "Offload",
    "PPGradReduce",
    "ParallelConfig",
    "PipelineSchedule",
    "PlannedSchedule",
    "PrecisionConfig",
    "PresetStyle",
    "Progress",
    "Recompute",
    "ReduceDType",
    "RopeScaling",
    "TokenDType",
    "TopKScope",
    "TrainConfig",
    "WandbMode",
    "check_batch",
    "check_choice",
    "check_choices",
    "check_compression",
    "check_compression_warmup",
    "check_cp_sequence",
    "check_document_mask",
    "check_expert_parallel",
    "check_generation_layout",
    "check_moe",
    "check_offload",
    "check_pipeline",
    "check_positive",
    "check_pp_reshard",
    "check_rope_scaling",
    "check_sample_length",
    "check_seq_len",
    "check_shard_size",
    "check_sp_under_cp",
    "check_tokenizer_vocab",
    "check_ulysses_heads",
    "check_world",
    "parse_step_window",
]
"""Every public name :mod:`plait.config` had as one module (the section classes, the
allowed-value types and tuples, and the config rules it used)."""
