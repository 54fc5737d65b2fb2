"""plait: distributed training for PyTorch on one device mesh.

Public API (see README.md):

- :func:`init_mesh`, :class:`Mesh`, :class:`MeshLayout`: the parallel layout.
- :mod:`plait.comm`: counted collectives and point-to-point on a mesh axis.
- :class:`DataParallel`: bucketed, overlapped data parallelism for any ``nn.Module``.
- :class:`Config` and its sections, :func:`load_config`: typed configuration.
- :class:`Transformer`: the built-in decoder-only model; :class:`Trainer`: the loop.
"""

from plait.config import (
    Config,
    DataConfig,
    LaunchConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from plait.config_io import load_config
from plait.errors import CommError, CommTimeoutError, ConfigError, DataError, PlaitError
from plait.mesh import AXES, Mesh, MeshLayout, init_mesh
from plait.model import Transformer
from plait.parallel.data import DataParallel
from plait.parallel.parallelize import parallelize
from plait.train.trainer import Trainer

__version__ = "0.1.0"

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
    "PlaitError",
    "TrainConfig",
    "Trainer",
    "Transformer",
    "__version__",
    "init_mesh",
    "load_config",
    "parallelize",
]
