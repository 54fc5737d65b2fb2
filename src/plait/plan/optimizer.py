"""The optimizer's part of a rank's memory and step time when it is not AdamW.

The rest of the planner counts AdamW (``Precision.optimizer_bytes``: m and v, 8 bytes a
parameter, sharded like the masters). ``train.optimizer`` changes two things:

* **state**: Muon keeps one fp32 momentum on the hidden matrices (4 bytes an element,
  sharded like the masters) and AdamW's 8 on the rest (embeddings, head, norms, biases);
  Adafactor keeps a row and a column factor of every 2-D tensor, whole on every rank
  that holds a piece of it (4 bytes times ``R + C``), and a per-element variance of the
  vectors (4 bytes, sharded) (:func:`state_bytes`);
* **step time** (:func:`plait.plan.optimizer_time.extra_seconds`): Muon's Newton-Schulz
  iterations at each matrix's owner (ZeRO 1-3: matrices dealt largest first to the
  least-loaded of the ``F`` shard ranks, as :func:`plait.parallel.zero.owners.
  assign_owners` deals them; otherwise every rank runs all of its stage's; under tp
  every tp rank runs each whole matrix), at the calibrated GEMM rate of a matrix that
  size, plus its exchanges: two all-to-alls over the shard group moving ``2 (F - 1) /
  F²`` of the stage's matrix bytes per rank (:func:`owner_exchange_bytes`) and, under
  tp, the all-gather of each matrix's update; Adafactor's two all-reduces of ``R + C +
  2`` elements per matrix and 2 per vector, over the shard group and tp.

The model is the planner's dense transformer: the hidden matrices of a block are the
attention's q, k, v, o and the MLP's (:func:`block_matrices`).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.config import OPTIMIZERS
from plait.config.choices import OptimizerName
from plait.config.rules.choices import check_choice
from plait.errors import ConfigError
from plait.plan.layout import Layout
from plait.plan.modelspec import ModelSpec

MASTER_BYTES = 4
"""Element size of the optimizer's state and of the exchanged updates (fp32 masters)."""
STEP_BYTES = 4
"""torch's per-tensor ``step`` scalar (float32)."""


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer the planned run steps with."""

    name: OptimizerName = "adamw"
    """``adamw`` (what the rest of the planner counts), ``muon`` or ``adafactor``."""
    ns_steps: int = 5
    """Muon's Newton-Schulz iterations (``optim.muon_ns_steps``)."""

    def __post_init__(self) -> None:
        check_choice("optimizer", self.name, OPTIMIZERS)
        if self.ns_steps < 1:
            raise ConfigError(f"ns_steps must be >= 1, got {self.ns_steps}.")


@dataclass(frozen=True)
class StageShape:
    """What one rank of a pipeline stage holds, in the terms this module needs."""

    layers: int
    """Transformer blocks of the stage."""
    params: int
    """Parameters one tp rank holds before ZeRO (its tensor-parallel share)."""
    tensors: int
    """Parameter tensors."""
    embedding: bool
    """The stage holds the token embedding (stage 0)."""
    head: bool
    """The stage holds an output head of its own (last stage, untied or pp > 1)."""


def block_matrices(spec: ModelSpec) -> list[tuple[int, int]]:
    """``(out, in)`` of one block's hidden matrices, whole: q, k, v, o, then the MLP's."""
    h, q, kv, f = spec.hidden, spec.q_width, spec.kv_width, spec.ffn_hidden
    mlp = [(f, h), (f, h), (h, f)] if spec.mlp_mats == 3 else [(f, h), (h, f)]
    return [(q, h), (kv, h), (kv, h), (h, q), *mlp]


def _matrix_elements(spec: ModelSpec, tp: int) -> int:
    """Elements of one block's hidden matrices on one tp rank (each is cut over tp)."""
    return sum(o * i for o, i in block_matrices(spec)) // tp


def state_bytes(
    spec: ModelSpec, opt: OptimizerSpec, layout: Layout, stage: StageShape, adamw: float
) -> float:
    """Optimizer-state bytes on one rank of ``stage`` (``adamw``: the bytes AdamW's two
    moments take there, which the other optimizers replace; see the module docstring)."""
    if opt.name == "adamw" or stage.params == 0:
        return adamw
    f = layout.shard_factor if layout.zero >= 1 else 1
    mats = stage.layers * _matrix_elements(spec, layout.tp)
    if opt.name == "muon":  # a momentum (4 bytes) on the matrices, AdamW's 8 on the rest
        moments = 4 * mats + 8 * (stage.params - mats)
        if layout.zero >= 1:  # the flat shards' exact bytes, in the same proportion
            return adamw * moments / (8 * stage.params)
        adam_tensors = stage.tensors - stage.layers * len(block_matrices(spec))
        return float(moments + STEP_BYTES * adam_tensors)  # AdamW's step scalars
    edges = (spec.vocab + spec.hidden) * (int(stage.embedding) + int(stage.head))
    factors = stage.layers * sum(o + i for o, i in block_matrices(spec)) + edges
    vocab_local = -(-spec.vocab // layout.tp) * spec.hidden
    edge_elements = vocab_local * (int(stage.embedding) + int(stage.head))
    vectors = max(0, stage.params - mats - edge_elements)
    return 4.0 * (factors + vectors / f) + STEP_BYTES * stage.tensors


def owner_exchange_bytes(matrix_elements: int, f: int) -> float:
    """Bytes one rank sends per step in Muon's owner exchange over ``f`` shard ranks:
    each matrix's pieces off its owner go there and come back, ``2 (1 - 1/f)`` of the
    stage's matrix bytes over the group, ``1/f`` of it per rank."""
    if f <= 1:
        return 0.0
    return 2.0 * (f - 1) / f * matrix_elements * MASTER_BYTES / f
