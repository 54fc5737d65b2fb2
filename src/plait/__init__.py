"""plait: distributed training for PyTorch on one device mesh.

Public API (see README.md), imported on first use so that ``import plait.plan`` or
``import plait.config`` needs no torch:

- :func:`init_mesh`, :class:`Mesh`, :class:`MeshLayout`: the parallel layout.
- :func:`parallelize` -> :class:`ParallelModel`; :mod:`plait.optim`: a training step.
- :mod:`plait.comm`: counted collectives and point-to-point on a mesh axis.
- :class:`DataParallel`: bucketed, overlapped data parallelism for any ``nn.Module``.
- :class:`Config` and its sections, :func:`load_config`: typed configuration.
- :class:`Transformer`: the built-in decoder-only model; :class:`Trainer`: the loop.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "Config": "plait.config",
    "DataConfig": "plait.config",
    "LaunchConfig": "plait.config",
    "LogConfig": "plait.config",
    "ModelConfig": "plait.config",
    "ParallelConfig": "plait.config",
    "PrecisionConfig": "plait.config",
    "TrainConfig": "plait.config",
    "load_config": "plait.config.toml_io",
    "CommError": "plait.errors",
    "CommTimeoutError": "plait.errors",
    "ConfigError": "plait.errors",
    "DataError": "plait.errors",
    "PlaitError": "plait.errors",
    "AXES": "plait.mesh",
    "Mesh": "plait.mesh",
    "MeshLayout": "plait.mesh",
    "init_mesh": "plait.mesh",
    "Transformer": "plait.model",
    "DataParallel": "plait.parallel.data_parallel",
    "ParallelModel": "plait.parallel.model",
    "parallelize": "plait.parallel.parallelize",
    "Trainer": "plait.train.trainer",
}
"""Public name -> the module that defines it."""

_SUBMODULES = ("comm", "optim")
"""Submodules reachable as attributes (``plait.comm``, ``plait.optim``)."""

if TYPE_CHECKING:
    from plait import comm, optim
    from plait.config import (
        Config,
        DataConfig,
        LaunchConfig,
        LogConfig,
        ModelConfig,
        ParallelConfig,
        PrecisionConfig,
        TrainConfig,
    )
    from plait.config.toml_io import load_config
    from plait.errors import CommError, CommTimeoutError, ConfigError, DataError, PlaitError
    from plait.mesh import AXES, Mesh, MeshLayout, init_mesh
    from plait.model import Transformer
    from plait.parallel.data_parallel import DataParallel
    from plait.parallel.model import ParallelModel
    from plait.parallel.parallelize import parallelize
    from plait.train.trainer import Trainer


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access (and a subpackage such as
    ``plait.model`` when it is asked for as an attribute)."""
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES or (
        not name.startswith("_") and importlib.util.find_spec(f"plait.{name}") is not None
    ):
        return importlib.import_module(f"plait.{name}")
    raise AttributeError(f"module 'plait' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY, *_SUBMODULES])


__all__ = [
    "AXES",
    "CommError",
    "CommTimeoutError",
    "Config",
    "ConfigError",
    "DataConfig",
    "DataError",
    "DataParallel",
    "LaunchConfig",
    "LogConfig",
    "Mesh",
    "MeshLayout",
    "ModelConfig",
    "ParallelConfig",
    "ParallelModel",
    "PlaitError",
    "PrecisionConfig",
    "TrainConfig",
    "Trainer",
    "Transformer",
    "__version__",
    "comm",
    "init_mesh",
    "load_config",
    "optim",
    "parallelize",
]
