"""Model shapes drawn at random away from every calibration point (issue 46).

A planner calibrated on a grid of shapes is only worth what it predicts off that grid.
:func:`draw_shapes` draws small decoder-only transformers for
``benchmarks/planner_vs_measured.py --shapes N --seed S``: hidden sizes 40-400 that are not
powers of two, head dimensions 16-48, sequences 64-320, micro-batches 1-8 and 2-6 layers,
such that

* no coordinate equals a value any calibration measurement runs at
  (:func:`calibration_points`: the block grids' hidden sizes, head dimension, sequence,
  batches and tokens, the attention curve's sequence lengths and batch, the tiny block's
  and the pipelines' shapes, and the ring attention chunk ``s / 4`` of the cp = 2 row
  against the attention curve);
* at least one of the hidden size and the tokens per micro-batch lies outside the block
  grid's range (:attr:`CalibrationPoints.hidden_range`, :attr:`~CalibrationPoints.tokens_range`);
* every layout of the benchmark can run it: an even head count (tp = 2), a sequence
  divisible by 4 (cp = 2 splits it in ``2·cp`` zigzag chunks; sequence parallelism by tp).

Drawing is rejection sampling from :class:`random.Random` seeded with ``seed``, so a seed
always gives the same shapes. Torch-free: it only reads the calibration constants.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

HIDDEN_RANGE = (40, 400)
"""Smallest and largest hidden size drawn."""
HEAD_DIM_RANGE = (16, 48)
"""Smallest and largest head dimension drawn (even: rotary rotates halves)."""
SEQ_RANGE = (64, 320)
"""Shortest and longest sequence drawn."""
MICRO_BATCH_RANGE = (1, 8)
"""Fewest and most sequences per micro-batch drawn."""
LAYERS_RANGE = (2, 6)
"""Fewest and most blocks drawn."""
SEQ_MULTIPLE = 4
"""Every sequence is a multiple of this: ``2·cp`` zigzag chunks at cp = 2 (and tp = 2
shards of sequence parallelism)."""
HEADS_MULTIPLE = 2
"""Every head count is a multiple of this: the tensor-parallel degree of the benchmark."""
RING_CP = 2
"""The context-parallel degree of the benchmark's ring row: its attention runs on chunks
of ``s / (2·cp)`` keys."""
MAX_TRIES = 100_000
"""Draws before :func:`draw_shape` gives up (it accepts about one in six)."""


@dataclass(frozen=True)
class Shape:
    """One drawn model shape and its micro-batch."""

    hidden: int
    """Hidden size (``heads x head_dim``)."""
    heads: int
    """Attention heads (query and key/value: no grouping)."""
    head_dim: int
    """Width of one head."""
    layers: int
    """Transformer blocks."""
    seq: int
    """Tokens per sequence."""
    micro_batch: int
    """Sequences per micro-batch."""

    def __post_init__(self) -> None:
        if self.heads * self.head_dim != self.hidden:
            raise ValueError(
                f"hidden {self.hidden} != heads {self.heads} x head_dim {self.head_dim}"
            )

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch (``micro_batch x seq``)."""
        return self.micro_batch * self.seq

    @property
    def name(self) -> str:
        """A short label: ``h{hidden} d{head_dim} L{layers} s{seq} b{micro_batch}``."""
        return f"h{self.hidden} d{self.head_dim} L{self.layers} s{self.seq} b{self.micro_batch}"

    def model_kwargs(self) -> dict[str, Any]:
        """The :class:`~plait.config.ModelConfig` fields of this shape (byte vocabulary)."""
        return {
            "vocab_size": 256,
            "dim": self.hidden,
            "n_layers": self.layers,
            "n_heads": self.heads,
            "max_seq_len": self.seq,
        }


@dataclass(frozen=True)
class CalibrationPoints:
    """Every value each shape coordinate takes in some calibration measurement."""

    hidden: frozenset[int]
    """Hidden sizes (and GEMM sizes) measured."""
    head_dim: frozenset[int]
    """Head dimensions measured."""
    seq: frozenset[int]
    """Sequence (and attention key) lengths measured."""
    micro_batch: frozenset[int]
    """Sequences per micro-batch measured."""
    layers: frozenset[int]
    """Blocks in the measured stacks and pipelines."""
    tokens: frozenset[int]
    """Tokens per micro-batch of the block grids."""
    hidden_range: tuple[int, int]
    """Smallest and largest hidden size of the block grid."""
    tokens_range: tuple[int, int]
    """Fewest and most tokens per micro-batch of the block grid."""


def calibration_points() -> CalibrationPoints:
    """The calibration's coordinates, read from the constants the measurements use
    (:mod:`plait.bench.measure`, :mod:`plait.bench.calibrate`,
    :mod:`plait.bench.calibrate_pipeline`), so that they cannot drift apart."""
    from plait.bench import calibrate, calibrate_pipeline, measure

    tiny, work = measure.TINY_BLOCK, calibrate_pipeline.WORK_PP_MODEL
    grid_tokens = [b * measure.BLOCK_GRID_SEQ for b in measure.BLOCK_GRID_BATCHES]
    ring_b, ring_h, ring_s, ring_d = calibrate.TINY_RING
    dims = [*measure.BLOCK_GRID_DIMS, *measure.MATMUL_SIZES, *measure.LINEAR_SIZES]
    return CalibrationPoints(
        hidden=frozenset([*dims, tiny["dim"], work["dim"], ring_h * ring_d]),
        head_dim=frozenset(
            [
                measure.ATTN_HEAD_DIM,
                measure.BLOCK_GRID_HEAD_DIM,
                tiny["dim"] // tiny["n_heads"],
                work["dim"] // work["n_heads"],
                ring_d,
            ]
        ),
        seq=frozenset(
            [
                *measure.ATTENTION_SEQS,
                measure.BLOCK_GRID_SEQ,
                tiny["max_seq_len"],
                work["max_seq_len"],
                ring_s,
                2 * RING_CP * ring_s,
            ]
        ),
        micro_batch=frozenset(
            [
                *measure.BLOCK_GRID_BATCHES,
                measure.ATTN_BATCH,
                measure.TINY_BATCH,
                calibrate_pipeline.TINY_PP_BATCH,
                calibrate_pipeline.WORK_PP_BATCH,
                ring_b,
            ]
        ),
        layers=frozenset([measure.BLOCK_GRID_DEPTH, calibrate_pipeline.TINY_PP_LAYERS, 1]),
        tokens=frozenset(grid_tokens),
        hidden_range=(min(measure.BLOCK_GRID_DIMS), max(measure.BLOCK_GRID_DIMS)),
        tokens_range=(min(grid_tokens), max(grid_tokens)),
    )


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def calibration_hits(shape: Shape, points: CalibrationPoints) -> list[str]:
    """The coordinates of ``shape`` equal to a calibration value, by name (empty: none)."""
    ring_chunk = shape.seq // (2 * RING_CP)
    checks = [
        ("hidden", shape.hidden in points.hidden),
        ("head_dim", shape.head_dim in points.head_dim),
        ("seq", shape.seq in points.seq),
        ("ring chunk", ring_chunk in points.seq),
        ("micro_batch", shape.micro_batch in points.micro_batch),
        ("layers", shape.layers in points.layers),
        ("tokens", shape.tokens in points.tokens),
        ("tokens per cp rank", shape.tokens // RING_CP in points.tokens),
    ]
    return [name for name, hit in checks if hit]


def off_grid(shape: Shape, points: CalibrationPoints) -> bool:
    """Whether the hidden size or the tokens per micro-batch lies outside the block grid's
    range (strictly)."""
    (h0, h1), (t0, t1) = points.hidden_range, points.tokens_range
    return not h0 <= shape.hidden <= h1 or not t0 <= shape.tokens <= t1


def acceptable(shape: Shape, points: CalibrationPoints) -> bool:
    """Every rule of the module docstring: in range, runnable by every layout, no
    calibration value, off the grid's range."""
    in_range = (
        HIDDEN_RANGE[0] <= shape.hidden <= HIDDEN_RANGE[1]
        and HEAD_DIM_RANGE[0] <= shape.head_dim <= HEAD_DIM_RANGE[1]
        and SEQ_RANGE[0] <= shape.seq <= SEQ_RANGE[1]
        and MICRO_BATCH_RANGE[0] <= shape.micro_batch <= MICRO_BATCH_RANGE[1]
        and LAYERS_RANGE[0] <= shape.layers <= LAYERS_RANGE[1]
    )
    runnable = (
        shape.heads % HEADS_MULTIPLE == 0
        and shape.seq % SEQ_MULTIPLE == 0
        and shape.head_dim % 2 == 0
    )
    return (
        in_range
        and runnable
        and not _power_of_two(shape.hidden)
        and not calibration_hits(shape, points)
        and off_grid(shape, points)
    )


def draw_shape(rng: random.Random, points: CalibrationPoints) -> Shape:
    """One acceptable shape (:func:`acceptable`) drawn from ``rng``."""
    head_dims = range(HEAD_DIM_RANGE[0], HEAD_DIM_RANGE[1] + 1, 2)
    seqs = range(SEQ_RANGE[0], SEQ_RANGE[1] + 1, SEQ_MULTIPLE)
    for _ in range(MAX_TRIES):
        d = rng.choice(head_dims)
        heads = rng.choice(range(HEADS_MULTIPLE, HIDDEN_RANGE[1] // d + 1, HEADS_MULTIPLE))
        shape = Shape(
            hidden=heads * d,
            heads=heads,
            head_dim=d,
            layers=rng.randint(*LAYERS_RANGE),
            seq=rng.choice(seqs),
            micro_batch=rng.randint(*MICRO_BATCH_RANGE),
        )
        if acceptable(shape, points):
            return shape
    raise RuntimeError(f"no acceptable shape in {MAX_TRIES} draws")


def draw_shapes(n: int, seed: int) -> list[Shape]:
    """``n`` acceptable shapes, the same for the same ``seed``."""
    if n < 1:
        raise ValueError(f"--shapes must be at least 1, got {n}")
    rng = random.Random(seed)
    points = calibration_points()
    return [draw_shape(rng, points) for _ in range(n)]
