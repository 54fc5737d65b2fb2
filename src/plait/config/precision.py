"""The precision section (``[precision]``): dtypes, gradient-reduction dtype, loss scaling."""

from __future__ import annotations

from dataclasses import dataclass

from plait.config.choices import DType, NonFinite, ReduceDType, check_choices
from plait.config.rules.choices import check_positive


@dataclass
class PrecisionConfig:
    """Mixed precision: parameter/compute dtype, gradient-reduction dtype, loss scaling."""

    dtype: DType = "fp32"
    """Dtype of the parameters and of the compute ('fp32', 'bf16', 'fp16'); with bf16 or
    fp16 the optimizer keeps fp32 master weights (sharded under ZeRO)."""
    reduce_dtype: ReduceDType = "auto"
    """Dtype gradients are reduced in across ranks ('auto': the parameter dtype)."""
    loss_scale: float = 65536.0
    """fp16 only: initial dynamic loss scale (2^16)."""
    loss_scale_window: int = 2000
    """fp16 only: double the loss scale after this many steps without overflow (K); an
    overflow halves it and skips the step."""
    nonfinite: NonFinite = "error"
    """A non-finite loss or gradient norm under fp32/bf16: 'error' stops the run with an
    error naming the step, 'skip' skips the step with a warning (weights, optimizer state
    and schedule untouched). fp16 overflows are always skipped by the loss scaler."""
    float8: bool = False
    """Compute the blocks' linear layers in float8 through torchao (not the output head;
    tensor-parallel layers too): CUDA with compute capability 8.9+ and the `float8` extra
    only, refused elsewhere. See docs/gpu.md."""

    def __post_init__(self) -> None:
        check_choices(self, "precision.")
        check_positive(
            "precision.", loss_scale=self.loss_scale, loss_scale_window=self.loss_scale_window
        )
