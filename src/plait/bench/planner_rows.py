"""The layouts ``benchmarks/planner_vs_measured.py`` measures, on its fixed model or on a
drawn shape (:mod:`plait.bench.random_shapes`).

:data:`ROWS` are the nine layouts at the fixed shape: the built-in ``small`` model at
sequence :data:`SEQ`. :meth:`Row.at` moves a row to a drawn shape, keeping its number of
micro-batches per step and data-parallel rank (2 for accumulation, 4 for the pipeline,
else 1) at the shape's micro-batch. Torch-free until :func:`available`, which asks the
runtime's own validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from plait.bench.random_shapes import Shape

MODEL = "small"
"""The fixed shape's model preset."""
SEQ = 128
"""The fixed shape's sequence length."""


@dataclass(frozen=True)
class Row:
    """One layout to measure."""

    name: str
    """The row's label in the tables."""
    world: int
    """Ranks it runs on."""
    parallel: dict[str, Any] = field(default_factory=dict)
    """Its :class:`~plait.config.ParallelConfig` fields."""
    global_batch: int = 16
    """Sequences per step, all ranks together."""
    micro_batch: int = 8
    """Sequences per micro-batch."""
    shape: Shape | None = None
    """The drawn shape it runs on; None: the fixed :data:`MODEL` at :data:`SEQ`."""

    @property
    def seq(self) -> int:
        """Tokens per sequence."""
        return SEQ if self.shape is None else self.shape.seq

    def at(self, shape: Shape) -> Row:
        """This layout on ``shape``: micro-batches of ``shape.micro_batch`` sequences, as
        many per step and data-parallel rank as this row has."""
        per_micro = self.global_batch // self.micro_batch
        return replace(
            self,
            global_batch=per_micro * shape.micro_batch,
            micro_batch=shape.micro_batch,
            shape=shape,
        )

    def config(self) -> dict[str, Any]:
        """The run's config sections as keyword dictionaries (picklable, for the ranks)."""
        if self.shape is None:
            from plait.model import MODEL_PRESETS

            preset = MODEL_PRESETS[MODEL]
            model = {k: getattr(preset, k) for k in preset.__dataclass_fields__}
        else:
            model = self.shape.model_kwargs()
        return {
            "model": model,
            "parallel": dict(self.parallel),
            "train": {
                "global_batch": self.global_batch,
                "micro_batch": self.micro_batch,
                "seq_len": self.seq,
                "steps": 1000,
            },
        }

    def full_config(self) -> Any:
        """The run's :class:`~plait.config.Config`."""
        from plait.config import Config, ModelConfig, ParallelConfig, TrainConfig

        c = self.config()
        return Config(
            model=ModelConfig(**c["model"]),
            parallel=ParallelConfig(**c["parallel"]),
            train=TrainConfig(**c["train"]),
        )


ROWS = [
    Row("dp1", 1, {"dp": 1}, 8, 8),
    Row("dp2", 2, {"dp": 2}, 16, 8),
    Row("dp2, accumulation 2", 2, {"dp": 2}, 16, 4),
    Row("zero3 dp2", 2, {"dp": 2, "zero": 3}, 16, 8),
    Row("tp2", 2, {"dp": 1, "tp": 2}, 8, 8),
    Row("tp2 + SP", 2, {"dp": 1, "tp": 2, "sequence_parallel": True}, 8, 8),
    Row("dp2 x tp2", 4, {"dp": 2, "tp": 2}, 16, 8),
    Row("pp2 1F1B", 2, {"dp": 1, "pp": 2}, 8, 2),
    Row("cp2", 2, {"dp": 1, "cp": 2}, 8, 8),
]
"""The nine layouts at the fixed shape."""


def rows_at(shape: Shape | None) -> list[Row]:
    """:data:`ROWS` on ``shape`` (the fixed shape for None)."""
    return list(ROWS) if shape is None else [r.at(shape) for r in ROWS]


def available(row: Row) -> str | None:
    """None when the runtime runs ``row``, else the reason it refuses."""
    from plait.errors import ConfigError
    from plait.parallel.checks import validate_run

    try:
        validate_run(row.full_config(), row.world)
    except (ConfigError, TypeError) as e:  # TypeError: a config field not there yet
        return str(e)
    return None
