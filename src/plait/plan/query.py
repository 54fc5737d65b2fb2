"""What the planner is asked: one model on one kind of device, at one batch, sequence,
precision and runtime (:class:`Query`).

Every planner function that needs more than a layout takes ``(q, layout)``: the query
bundles the model, the hardware, the precision, the runtime, the sequence length, the
headroom and the MoE part, so no function takes them as loose arguments in an order of
its own. :meth:`Query.of_layout` builds the query of one layout (its devices and global
batch) for the callers that evaluate a single layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.errors import ConfigError
from plait.plan.hardware import Hardware
from plait.plan.layout import Layout, Precision, Runtime
from plait.plan.lora import LoraSpec
from plait.plan.modelspec import ModelSpec
from plait.plan.moe import MoESpec
from plait.plan.optimizer import OptimizerSpec

MAX_DEVICES = 1 << 24
"""Most devices a search plans for (16,777,216; bounds the layouts it walks)."""


@dataclass(frozen=True)
class Query:
    """What to plan for."""

    model: ModelSpec
    """The model."""
    hardware: Hardware
    """The device kind."""
    devices: int
    """Devices in the job."""
    global_batch: int
    """Sequences per optimizer step."""
    seq_len: int
    """Tokens per sequence."""
    precision: Precision
    """Precision policy."""
    runtime: Runtime
    """Runtime traits."""
    headroom: float = 0.05
    """Fraction of device memory kept free."""
    moe: MoESpec | None = None
    """The mixture-of-experts part of the model (None: dense): the search then also tries
    every expert-parallel degree ep that divides dp·cp and the experts."""
    lora: LoraSpec | None = None
    """LoRA adapters on a frozen base (None: the whole model is trained)."""
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    """The optimizer (AdamW by default; Muon and Adafactor change the state and the step,
    :mod:`plait.plan.optimizer`)."""

    def __post_init__(self) -> None:
        for key in ("devices", "global_batch", "seq_len"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key} must be positive, got {getattr(self, key)}.")
        if self.devices > MAX_DEVICES:
            raise ConfigError(
                f"devices {self.devices:,} is more than the planner searches ({MAX_DEVICES:,}); "
                "plan a slice of the cluster (the per-rank figures do not change with dp)."
            )
        if not 0.0 <= self.headroom < 1.0:
            raise ConfigError(f"headroom must be in [0, 1), got {self.headroom}.")

    @classmethod
    def of_layout(
        cls,
        model: ModelSpec,
        layout: Layout,
        hardware: Hardware,
        precision: Precision,
        runtime: Runtime,
        seq_len: int,
        headroom: float = 0.05,
        moe: MoESpec | None = None,
        lora: LoraSpec | None = None,
        optimizer: OptimizerSpec | None = None,
    ) -> Query:
        """The query whose devices and global batch are ``layout``'s."""
        return cls(
            model,
            hardware,
            layout.world,
            layout.global_batch,
            seq_len,
            precision,
            runtime,
            headroom,
            moe,
            lora,
            optimizer or OptimizerSpec(),
        )
