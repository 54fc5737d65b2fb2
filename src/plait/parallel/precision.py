"""Mixed precision: the dtype policy, fp32 master weights, the dynamic loss scaler.

A :class:`PrecisionPolicy` names three dtypes:

* ``param_dtype`` — the dtype the model's parameters are stored in and compute runs in
  (fp32, bf16 or fp16). Activations follow the parameters; norms and the loss are
  computed in fp32 by the model itself.
* ``reduce_dtype`` — the dtype gradients are reduced (all-reduce / reduce-scatter) in;
  ``auto`` is the parameter dtype.
* the master dtype, always fp32: the (sharded) optimizer keeps fp32 master copies of
  16-bit parameters, applies the update to them and casts the result back
  (Micikevicius et al. 2018, "Mixed Precision Training").

fp16 has a narrow exponent range, so small gradients underflow. The
:class:`DynamicLossScaler` multiplies the loss by a scale S (initially 2^16) before
backward and divides the gradients by S before the step. A step whose gradients hold an
inf or NaN is *skipped* — weights, optimizer state and the learning-rate schedule stay
exactly as they were — and S is halved; after K clean steps in a row S is doubled.
bf16 has fp32's exponent range and needs no scaling.

:func:`check_device_supports` refuses a dtype the device cannot compute in, before any
process starts.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from plait.errors import ConfigError, PlaitError

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
"""Config names of the floating-point dtypes plait trains in."""


def dtype_name(dtype: torch.dtype) -> str:
    """The config name of ``dtype`` ("fp32", "bf16", "fp16")."""
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    return str(dtype).replace("torch.", "")


def is_low_precision(dtype: torch.dtype) -> bool:
    """bf16 and fp16: dtypes whose parameters need fp32 master copies."""
    return dtype in (torch.bfloat16, torch.float16)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16`` (a ``torch.dtype`` passes through)."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


class NonFiniteError(PlaitError, FloatingPointError):
    """The loss or the gradients were not finite and the policy is to stop."""


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype parameters/compute, gradient reduction and master weights use."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None  # None: the parameter dtype

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        """The reduction dtype with the default applied."""
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype

    @property
    def needs_master_weights(self) -> bool:
        """Whether the optimizer must keep separate fp32 master copies (16-bit params)."""
        return is_low_precision(self.param_dtype)

    @property
    def needs_loss_scaling(self) -> bool:
        """fp16 needs dynamic loss scaling; fp32 and bf16 do not."""
        return self.param_dtype == torch.float16

    @classmethod
    def from_names(cls, dtype: str, reduce_dtype: str = "auto") -> PrecisionPolicy:
        """Build from config names (``reduce_dtype="auto"``: the parameter dtype)."""
        return cls(
            parse_dtype(dtype), None if reduce_dtype == "auto" else parse_dtype(reduce_dtype)
        )


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 training.

    ``scale_loss(loss)`` multiplies by the current scale; after backward the optimizer
    divides the gradients by :attr:`scale` and calls :meth:`update` with whether any
    gradient was inf/NaN. An overflow multiplies the scale by ``backoff_factor`` (0.5)
    and resets the clean-step count; ``growth_interval`` (K) clean steps in a row
    multiply it by ``growth_factor`` (2).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ) -> None:
        if init_scale <= 0 or growth_interval < 1:
            raise ValueError("init_scale must be positive and growth_interval >= 1")
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError("growth_factor must be > 1 and backoff_factor in (0, 1)")
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.clean_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (computed in the loss's dtype, normally fp32)."""
        return loss * self.scale

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; grow after ``growth_interval`` clean steps."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly."""
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values."""
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])


FUSED_DEVICES = ("cpu", "cuda")
"""Device types where ``torch.optim.AdamW(fused=True)`` has a kernel (one call per step
for every parameter, instead of a Python loop over parameters)."""


def optimizer_kernel(params: Iterable[torch.Tensor]) -> dict[str, bool]:
    """The fastest kernel choice for an element-wise ``torch.optim`` optimizer (Adam,
    AdamW, SGD) over ``params``: ``{"fused": True}`` when every parameter is a
    floating-point tensor on a device of :data:`FUSED_DEVICES`, else
    ``{"foreach": True}`` (grouped kernels) where every parameter is on a real device,
    else ``{}`` (torch's default).

    torch's default is ``foreach`` on CUDA only: on the CPU it is the single-tensor
    loop, a handful of element-wise kernels *per parameter* (add_, mul_, lerp_,
    addcmul_, sqrt, addcdiv_), which is what made plait's CPU step slower than a plain
    loop with ``AdamW(fused=True)`` (see benchmarks/eager_step.py). Under ZeRO the
    optimizer is rebuilt over the fp32 master shards with the same defaults, so the
    masters get the same kernel.
    """
    ps = list(params)
    if not ps or any(p.is_meta for p in ps):
        return {}
    if all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in ps):
        return {"fused": True}
    return {"foreach": True}


@functools.cache
def _cpu_can_compute(dtype: torch.dtype) -> bool:
    """Run a tiny matmul + backward in ``dtype`` on the CPU; False if the kernels fail."""
    try:
        a = torch.ones(4, 4, dtype=dtype, requires_grad=True)
        (a @ a).float().sum().backward()
        return a.grad is not None and bool(torch.isfinite(a.grad.float()).all())
    except (RuntimeError, NotImplementedError):
        return False


def device_supports(dtype: torch.dtype, device: str) -> tuple[bool, str]:
    """Whether ``device`` ("cpu" or "cuda") can train in ``dtype``; (ok, reason if not)."""
    if dtype == torch.float32:
        return True, ""
    name = dtype_name(dtype)
    if device == "cuda":
        if not torch.cuda.is_available():
            return False, f"{name} was requested on CUDA, but no CUDA device is available"
        major, minor = torch.cuda.get_device_capability()
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            return False, f"this GPU (compute capability {major}.{minor}) has no bf16 support"
        if dtype == torch.float16 and (major, minor) < (5, 3):
            return False, f"this GPU (compute capability {major}.{minor}) has no fp16 arithmetic"
        return True, ""
    if not _cpu_can_compute(dtype):
        return False, f"this CPU build of PyTorch cannot run {name} matmuls and their backward"
    return True, ""


def check_device_supports(dtype_name_: str, device: str) -> None:
    """Raise :class:`ConfigError` when ``device`` ("auto", "cpu", "cuda") cannot train in
    the dtype named ``dtype_name_``."""
    dtype = parse_dtype(dtype_name_)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    ok, reason = device_supports(dtype, device)
    if not ok:
        raise ConfigError(
            f"precision.dtype = {dtype_name_!r} cannot run here: {reason}. "
            "Use precision.dtype = 'fp32' (or 'bf16' where supported), or another device."
        )
