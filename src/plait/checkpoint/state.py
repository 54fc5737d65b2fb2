"""TrainState: everything a checkpoint saves and a resume restores, behind protocols.

Checkpointing sees the training state only through this object and the local-pieces
protocol (:mod:`plait.pieces`), so it names no parallelism and no built-in module: the
model describes which parameter pieces this rank holds in one-device names, the
optimizer adds where each piece's master values and state live, and the rest is plain
data (the sampler's position, the schedule's clock, the loss scaler, the RNG states,
which :mod:`plait.checkpoint.rank_state` captures per rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from plait.checkpoint.rank_state import HoldsRankState
from plait.config import Config
from plait.mesh import Mesh
from plait.pieces import LocalPiece


class DescribesPieces(Protocol):
    """A model that can list its parameters' one-device names (the parallel model)."""

    param_names: list[str]
    """Every parameter's one-device name, in the one-device model's order."""

    def local_pieces(self) -> list[LocalPiece]:
        """The pieces this rank holds, with the model's own storage (``value``)."""
        ...


class HoldsPieces(Protocol):
    """An optimizer that says which pieces it steps and where their state lives."""

    inner: torch.optim.Optimizer
    steps: int
    skipped: int
    scaler: Any

    def local_pieces(self) -> list[LocalPiece]:
        """Pieces with their master values (``value``) and state keys (``key``)."""
        ...


class Resumable(Protocol):
    """A sampler whose position is saved and restored."""

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values."""
        ...


@dataclass
class TrainState:
    """What one rank's training run consists of, for saving and resuming."""

    model: DescribesPieces
    """The parallel model (its one-device parameter names)."""
    optimizer: HoldsPieces
    """The optimizer wrapper (pieces, inner state, counters, loss scaler)."""
    sampler: Resumable
    """The distributed batch sampler."""
    mesh: Mesh
    """The layout the state lives on."""
    config: Config
    """The run's configuration (recorded in the metadata)."""
    sched_step: int = 0
    """Applied (not skipped) optimizer steps: the learning-rate schedule's clock."""
    rank_state: HoldsRankState | None = None
    """Per-rank state saved in the rank's own shard (the gradient compressor's)."""

    @property
    def device(self) -> torch.device:
        """The device this rank computes on."""
        return self.mesh.device
