"""Typed configuration for a plait run: the one configuration package.

Every field has a docstring (the string literal under it); `plait train --help-config`
prints them. Each dataclass validates its own fields in ``__post_init__``; checks that
need several sections (the layout against the world size, the global batch against
the layout) run in :meth:`Config.validate`, before any process starts. The rules
themselves are written once, as torch-free functions on plain values, in
:mod:`plait.config.rules` (which imports nothing from the value modules); the
constructors that need a rule call the same one.

Each set of allowed values (pipeline schedules, recompute policies, offload kinds, ...)
is declared once, as a ``Literal`` type in :mod:`plait.config.choices`; the tuple of its
values is derived from it (``typing.get_args``).

The **global batch** (``train.global_batch``, in sequences) is the invariant of a run:
the per-rank micro-batch and the number of accumulation steps are derived from it and
the data-parallel degree, so changing the layout never changes the math.

Inside the package, in import order (``tests/test_layers.py`` checks it):

* **rules**: :mod:`plait.config.rules` (one module per kind of rule);
* **values**: one module per section, in section order (:mod:`~plait.config.model`,
  :mod:`~plait.config.parallel`, :mod:`~plait.config.train`, :mod:`~plait.config.optim`,
  :mod:`~plait.config.precision`, :mod:`~plait.config.data`, :mod:`~plait.config.log`,
  :mod:`~plait.config.launch`), the allowed values (:mod:`~plait.config.choices`) and the
  root :class:`Config` (:mod:`~plait.config.root`); this package re-exports the names
  other packages use;
* **reading and writing**, which may import the values but not the other way round:
  :mod:`~plait.config.coerce` (nested dicts and back, the schema),
  :mod:`~plait.config.toml_io` (TOML files, :func:`~plait.config.toml_io.load_config`),
  :mod:`~plait.config.overrides` (command-line overrides and short aliases),
  :mod:`~plait.config.help_text` (``--help-config``), and the named model shapes
  (:mod:`~plait.config.presets`).
"""

from __future__ import annotations

from plait.config.choices import (
    COMPRESSIONS,
    CP_ATTENTIONS,
    NONFINITES,
    OFFLOADS,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    PLANNED_SCHEDULES,
    PP_GRAD_REDUCES,
    PRESET_STYLES,
    RECOMPUTES,
    TOKEN_DTYPES,
    TOPK_SCOPES,
    ZERO_MEANING,
    ZERO_STAGES,
    Balance,
    Compression,
    CPAttention,
    NonFinite,
    Offload,
    PlannedSchedule,
    PPGradReduce,
    PresetStyle,
    Recompute,
    TopKScope,
    check_choices,
)
from plait.config.data import DataConfig
from plait.config.launch import LaunchConfig
from plait.config.log import LogConfig
from plait.config.lora import LoraConfig
from plait.config.model import ModelConfig
from plait.config.optim import OptimConfig
from plait.config.parallel import ParallelConfig
from plait.config.precision import PrecisionConfig
from plait.config.root import Config
from plait.config.train import TrainConfig

__all__ = [
    "COMPRESSIONS",
    "CP_ATTENTIONS",
    "NONFINITES",
    "OFFLOADS",
    "OPTIMIZERS",
    "PIPELINE_SCHEDULES",
    "PLANNED_SCHEDULES",
    "PP_GRAD_REDUCES",
    "PRESET_STYLES",
    "RECOMPUTES",
    "TOKEN_DTYPES",
    "TOPK_SCOPES",
    "ZERO_MEANING",
    "ZERO_STAGES",
    "Balance",
    "CPAttention",
    "Compression",
    "Config",
    "DataConfig",
    "LaunchConfig",
    "LogConfig",
    "LoraConfig",
    "ModelConfig",
    "NonFinite",
    "Offload",
    "OptimConfig",
    "PPGradReduce",
    "ParallelConfig",
    "PlannedSchedule",
    "PrecisionConfig",
    "PresetStyle",
    "Recompute",
    "TopKScope",
    "TrainConfig",
    "check_choices",
]
"""The names other packages import from here: the sections, the root, and the
allowed-value sets they use (every other allowed-value type is in
:mod:`plait.config.choices`)."""
