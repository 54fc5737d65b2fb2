"""Apply parallelism to a model written for one device, in one fixed order.

The order (as in DESIGN.md): tensor/sequence parallel -> context parallel -> pipeline
split -> activation recomputation -> ZeRO/FSDP sharding or data parallel. Each step
replaces or wraps modules from outside; the model file never changes. This version
implements the last step, data parallelism; the others are refused by
:meth:`plait.config.Config.validate` before any process starts.
"""

from __future__ import annotations

from torch import nn

from plait.config import ParallelConfig
from plait.mesh import Mesh
from plait.parallel.data import DataParallel


def parallelize(model: nn.Module, mesh: Mesh, cfg: ParallelConfig) -> nn.Module:
    """Return ``model`` prepared for ``mesh`` according to ``cfg``.

    Data parallelism wraps the model even when dp = 1: one rank is the degenerate case
    of the same code path (its all-reduces are counted no-ops).
    """
    return DataParallel(
        model,
        mesh,
        bucket_mb=cfg.bucket_mb,
        find_unused_parameters=cfg.find_unused_parameters,
    )
