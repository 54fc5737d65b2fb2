"""The vocabulary of pipeline schedules: actions per rank, as plain data.

A schedule (see ``schedules.py``) is, for each pipeline rank, the ordered tuple of
:class:`Action` it performs in one optimizer step. The validator and the simulator read
these tuples; the runtime (``runtime.py``) executes them; ``plait pipeline draw``
draws them. Nothing here touches torch.

Stages are *virtual* stages ``0 .. p*v - 1`` (p ranks, v chunks per rank): stage ``s``
lives on rank ``s % p`` as its local chunk ``s // p`` (round-robin, as in interleaved
1F1B; with v = 1 stage and rank coincide). Stage 0 holds the embedding, stage
``p*v - 1`` the final norm, head and loss.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Op(str, enum.Enum):
    """What an action does."""

    FORWARD = "F"
    """Forward of one micro-batch through one stage (keeps what backward needs)."""
    BACKWARD = "B"
    """Full backward of one micro-batch through one stage (input and weight gradients)."""
    BACKWARD_INPUT = "I"
    """Zero-bubble split: only the gradient with respect to the stage input."""
    BACKWARD_WEIGHT = "W"
    """Zero-bubble split: only the weight gradients (after the matching ``I``)."""
    SEND_ACT = "SEND_F"
    """Send this stage's output activation to stage + 1."""
    RECV_ACT = "RECV_F"
    """Receive this stage's input activation from stage - 1."""
    SEND_GRAD = "SEND_B"
    """Send the gradient with respect to this stage's input to stage - 1."""
    RECV_GRAD = "RECV_B"
    """Receive the gradient with respect to this stage's output from stage + 1."""

    @property
    def is_comm(self) -> bool:
        return self in (Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD, Op.RECV_GRAD)

    @property
    def is_compute(self) -> bool:
        return not self.is_comm


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank's schedule."""

    op: Op
    """What to do."""
    microbatch: int
    """Micro-batch index, 0 .. m - 1."""
    stage: int
    """Virtual stage index, 0 .. p*v - 1 (the rank is ``stage % p``)."""

    def __str__(self) -> str:
        return f"{self.op.value}{self.microbatch}@s{self.stage}"


@dataclass(frozen=True)
class Schedule:
    """A whole pipeline schedule: the ordered actions of every rank for one step."""

    name: str
    """Schedule name ("naive", "gpipe", "1f1b", "interleaved", "zb")."""
    stages: int
    """Pipeline ranks p."""
    microbatches: int
    """Micro-batches per step m."""
    chunks: int
    """Model chunks per rank v (1 except for interleaved schedules)."""
    actions: tuple[tuple[Action, ...], ...]
    """``actions[r]`` is rank r's ordered list of actions."""

    @property
    def virtual_stages(self) -> int:
        """p · v, the number of model pieces."""
        return self.stages * self.chunks

    def rank_of(self, stage: int) -> int:
        """The rank that holds virtual stage ``stage`` (round-robin)."""
        return stage % self.stages

    def chunk_of(self, stage: int) -> int:
        """The local chunk index of virtual stage ``stage`` on its rank."""
        return stage // self.stages
