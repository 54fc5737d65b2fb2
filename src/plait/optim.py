"""One optimizer wrapper for every layout: global-norm clipping, loss scaling, skipping.

:class:`Optimizer` wraps any element-wise ``torch.optim`` optimizer (AdamW, Adam, SGD
with momentum, ...) around a model that describes its layout through one small
protocol, :class:`OptimizerTarget`: a :class:`~plait.parallel.model.ParallelModel`, a
bare :class:`~plait.parallel.data_parallel.DataParallel` or :class:`~plait.parallel.zero.
ZeroDataParallel` wrapper, or (through :class:`PlainModule`) a plain module whose
gradients are complete on every rank. It takes what depends on the layout from there:

* under ZeRO (stages 0-3: :meth:`OptimizerTarget.zero_wrapper`), the optimizer is
  rebuilt over this rank's fp32 master *shards*
  (:class:`~plait.parallel.zero.optim.ShardedMasters`); otherwise the parameters are
  their own masters and must be fp32 or fp64;
* the groups the global gradient norm is summed over (ZeRO shard group, tp, pp:
  :meth:`OptimizerTarget.norm_groups`) and each tensor's weight in it (1/k for a
  tensor held identically by k tp ranks, 0 for the last stage's copy of a tied matrix:
  :meth:`OptimizerTarget.norm_weight`), so every element counts exactly once;
* the pieces a checkpoint saves (:meth:`OptimizerTarget.local_pieces`).

One :meth:`Optimizer.step`:

1. master gradients (ZeRO: the reduced gradient shards in fp32), divided by the loss
   scale;
2. the global L2 norm: the weighted local squared norm, summed over the norm groups;
3. a non-finite norm (or loss) skips the step: fp16 backs the loss scale off
   (:class:`~plait.parallel.precision.DynamicLossScaler`); fp32/bf16 warn or raise
   according to the policy. A skipped step touches neither weights nor optimizer state;
4. clipping by ``max_norm / (norm + 1e-6)`` (torch's formula), the inner step, and
   under ZeRO the copy of the masters back into the model dtype and the all-gather of
   the updated shards (stages 1/2).

Without clipping, loss scaling or the "skip" policy (and without ZeRO-Offload), nothing
in the step depends on the norm's value, so the step does not wait for it (no host
sync on a GPU, :attr:`Optimizer.sync_free`): the norm stays on the device, a copy to
the host is started (:class:`plait.host_scalar.HostScalar`), and its finiteness is
checked when :attr:`StepReport.grad_norm` is read or at the start of the next step,
whichever is first. A non-finite norm then raises :class:`NonFiniteError` as before,
with the step it belongs to, after that step's update (the run stops either way).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from plait import comm
from plait.comm import AxisGroup
from plait.config import NONFINITES, NonFinite
from plait.config.rules.choices import check_choice
from plait.host_scalar import HostScalar
from plait.parallel.adafactor import is_block
from plait.parallel.precision import DynamicLossScaler, NonFiniteError, is_low_precision
from plait.parallel.tensor.layers import tp_norm_weight
from plait.parallel.zero import ZeroDataParallel
from plait.parallel.zero.optim import OptimizerFactory, ShardedMasters
from plait.pieces import LocalPiece

_NOT_ELEMENTWISE = ("LBFGS", "SparseAdam")


@dataclass
class StepReport:
    """What one optimizer step did."""

    norm: float | HostScalar  # global L2 norm before clipping (after unscaling)
    skipped: bool
    loss_scale: float | None  # the scale the step's loss was multiplied by (fp16)
    reason: str = ""
    check: Callable[[], None] | None = None  # a sync-free step's deferred finiteness check

    @property
    def grad_norm(self) -> float:
        """The norm as a number (a sync-free step: waits for the norm's copy only, and
        raises :class:`NonFiniteError` if it is not finite)."""
        if self.check is not None:
            self.check()
        return self.norm if isinstance(self.norm, float) else self.norm.value()


@runtime_checkable
class OptimizerTarget(Protocol):
    """What :class:`Optimizer` needs from a model: its parameters and its layout.

    :class:`~plait.parallel.model.ParallelModel`,
    :class:`~plait.parallel.data_parallel.DataParallel` and
    :class:`~plait.parallel.zero.ZeroDataParallel` implement it (a ``ParallelModel``
    composes its data wrapper's answers with the pipeline's); :class:`PlainModule`
    adapts a plain module.
    """

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The model's parameters (those with ``requires_grad`` are trained)."""
        ...

    def norm_groups(self) -> list[AxisGroup]:
        """The groups the local squared gradient norm is summed over, in order, so every
        element of the model counts on exactly one rank (replicas are not summed)."""
        ...

    def norm_weight(self, p: torch.Tensor) -> float:
        """The weight of parameter ``p``'s local squared gradient norm (1/k for a tensor
        held identically by k ranks of a norm group, 0 for a copy counted elsewhere)."""
        ...

    def local_pieces(self) -> list[LocalPiece]:
        """The parameter pieces this rank holds, in one-device names (checkpoints)."""
        ...

    def zero_wrapper(self) -> ZeroDataParallel | None:
        """The ZeRO wrapper whose flat shards the optimizer steps as fp32 masters
        (:class:`~plait.parallel.zero.optim.ShardedMasters`), or None: the trainable
        parameters are their own masters."""
        ...


class PlainModule:
    """:class:`OptimizerTarget` of a plain module whose gradients are complete on every
    rank (one process, or reduced by the caller): no norm groups; a tensor-parallel
    parameter still weighs 1/k (its replicas on other ranks are not summed); no ZeRO
    shards. It cannot describe its pieces to a checkpoint."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The module's parameters."""
        return self.module.parameters(recurse)

    def norm_groups(self) -> list[AxisGroup]:
        """None: the local norm is the global one."""
        return []

    def norm_weight(self, p: torch.Tensor) -> float:
        """1/k for a tensor held identically by k tp ranks, else 1."""
        return tp_norm_weight(p)

    def local_pieces(self) -> list[LocalPiece]:
        """Refused: a plain module does not know which rank writes what."""
        raise TypeError(
            f"{type(self.module).__name__} does not describe its pieces; wrap it "
            "with plait.parallelize"
        )

    def zero_wrapper(self) -> None:
        """No ZeRO shards."""
        return None


class Optimizer:
    """Wrap ``optimizer`` for ``model`` (see the module docstring).

    Args:
        model: an :class:`OptimizerTarget` (a ``ParallelModel`` or a bare
            data-parallel / ZeRO wrapper), or a plain module whose gradients are
            complete on every rank (adapted by :class:`PlainModule`).
        optimizer: a ``torch.optim`` optimizer built over the model's parameters (its
            param groups and defaults are copied under ZeRO; it must not have stepped
            yet), or a factory ``groups -> optimizer``.
        max_norm: clip gradients to this global L2 norm (0: no clipping).
        scaler: the dynamic loss scaler (fp16).
        nonfinite: "error" (raise :class:`NonFiniteError`) or "skip" (warn) when the
            loss or gradient norm is not finite and no scaler is in use.
    """

    def __init__(
        self,
        model: OptimizerTarget | nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        *,
        max_norm: float = 0.0,
        scaler: DynamicLossScaler | None = None,
        nonfinite: NonFinite = "error",
    ) -> None:
        if max_norm < 0:
            raise ValueError(f"max_norm must not be negative, got {max_norm}")
        check_choice("nonfinite", nonfinite, NONFINITES)
        if isinstance(optimizer, torch.optim.Optimizer):
            if type(optimizer).__name__ in _NOT_ELEMENTWISE:
                raise TypeError(
                    f"{type(optimizer).__name__} needs whole parameters; plait's Optimizer "
                    "shards flat parameters and supports element-wise optimizers only"
                )
            if any(optimizer.state.values()):
                raise ValueError("wrap the optimizer before its first step (it has state)")
            adam = getattr(getattr(model, "compressor", None), "adam", None)
            if adam is not None and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                raise ValueError(
                    "this model's top-k compression runs Adam on each rank before the "
                    "exchange (compression_adam = 'before'); step it with "
                    "torch.optim.SGD(momentum=0), or set compression_adam = 'after'"
                )
        self.model = model
        self.max_norm = max_norm
        self.scaler = scaler
        self.nonfinite = nonfinite
        self.steps = 0
        self.skipped = 0
        self._pending: tuple[int, HostScalar] | None = None  # a sync-free step's norm
        self.target: OptimizerTarget = (
            model if isinstance(model, OptimizerTarget) else PlainModule(model)
        )
        self.zero = self.target.zero_wrapper()
        self._groups = self.target.norm_groups()
        self.sharded: ShardedMasters | None = None
        self._params: list[torch.Tensor] = []
        if self.zero is not None:
            self.sharded = ShardedMasters(self.zero, optimizer)
            self.inner = self.sharded.inner
            if self.sharded.host is not None:  # offload: step units during backward?
                self.sharded.host.eager = max_norm == 0 and scaler is None and nonfinite == "error"
            return
        params = [p for p in self.target.parameters() if p.requires_grad]
        if any(is_low_precision(p.dtype) for p in params):
            raise TypeError(
                "16-bit parameters need fp32 master weights: parallelize with "
                "precision='bf16'/'fp16' (or wrap the model in ZeroDataParallel; stage 0 "
                "replicates, as plain data parallelism does)"
            )
        if isinstance(optimizer, torch.optim.Adafactor) and any(is_block(p) for p in params):
            raise TypeError(
                "torch.optim.Adafactor on tensor- or expert-parallel blocks would keep each "
                "block's statistics; use plait.train.matrix_optim.make_adafactor "
                "(plait.optimizers.adafactor.ShardedAdafactor over the blocks)"
            )
        self.inner = (
            optimizer
            if isinstance(optimizer, torch.optim.Optimizer)
            else optimizer([{"params": params}])
        )
        self._params = [p for g in self.inner.param_groups for p in g["params"]]

    # ------------------------------------------------------------------ API

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (set ``lr`` here)."""
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        """The inner optimizer's state (for the shards only under ZeRO)."""
        return self.inner.state

    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before backward (1 without fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward()`` on: multiplied by the loss scale under fp16."""
        return self.scaler.scale_loss(loss) if self.scaler is not None else loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (ZeRO: zero the gradient buffers and shards)."""
        if self.zero is not None:
            self.zero.zero_grad()
        else:
            self.inner.zero_grad(set_to_none=set_to_none)

    @property
    def sync_free(self) -> bool:
        """Whether :meth:`step` runs without reading the norm on the host: no clipping,
        no loss scaler, the "error" policy, no ZeRO-Offload (see the module docstring)."""
        host = self.sharded.host if self.sharded is not None else None
        return (
            self.max_norm == 0
            and self.scaler is None
            and self.nonfinite == "error"
            and (host is None)
        )

    def check_pending(self) -> None:
        """Raise :class:`NonFiniteError` if the last sync-free step's norm was not finite
        (waits for that norm's copy to the host, not for later work); a no-op otherwise."""
        pending, self._pending = self._pending, None
        if pending is not None:
            step, norm = pending
            value = norm.value()
            if not math.isfinite(value):
                raise NonFiniteError(
                    f"optimizer step {step}: the gradient norm is not finite ({value}), "
                    "found after the step (without clipping the step does not wait for the "
                    "norm); stopping. Set precision.nonfinite = 'skip' to skip such steps "
                    "instead, or lower the learning rate."
                )

    @torch.no_grad()
    def step(self, loss_finite: bool = True) -> StepReport:
        """Unscale, measure the global norm, skip or clip, step, write back (see above)."""
        self.check_pending()
        if self.sync_free and loss_finite:
            return self._step_sync_free()
        scale = self.scaler.scale if self.scaler is not None else None
        grads = self._master_grads()
        host = self.sharded.host if self.sharded is not None else None
        deferred = host is not None and host.scales_on_host  # offload's ring: scaled there
        if scale is not None and not deferred:
            torch._foreach_mul_(grads, 1.0 / scale)
        norm = self._global_norm(grads)
        if scale is not None and host is not None and deferred:
            host.scale(1.0 / scale)
            norm *= 1.0 / scale
        if not (math.isfinite(norm) and loss_finite):
            what = "loss" if not loss_finite else "gradient norm"
            self.skipped += 1
            if self.sharded is not None and self.sharded.host is not None:
                self.sharded.host.discard()
            if self.scaler is not None:
                self.scaler.update(found_inf=True)
                return StepReport(norm, True, scale, f"fp16 overflow ({what} not finite)")
            msg = f"optimizer step {self.steps + self.skipped}: the {what} is not finite"
            if self.nonfinite == "error":
                raise NonFiniteError(
                    f"{msg} ({norm}); stopping. Set precision.nonfinite = 'skip' to skip such "
                    "steps instead, or lower the learning rate."
                )
            warnings.warn(f"{msg}; the step is skipped", RuntimeWarning, stacklevel=2)
            return StepReport(norm, True, scale, f"{what} not finite")
        if self.max_norm > 0:
            coef = self.max_norm / (norm + 1e-6)
            if coef < 1.0 and host is not None and deferred:
                host.scale(coef)
            elif coef < 1.0:
                torch._foreach_mul_(grads, coef)
        if self.sharded is not None:
            self.sharded.step(grads)
        else:
            self.inner.step()
        if self.scaler is not None:
            self.scaler.update(found_inf=False)
        self.steps += 1
        return StepReport(norm, False, scale)

    def _step_sync_free(self) -> StepReport:
        """The step without reading the norm (:attr:`sync_free`): the inner step at once,
        the norm's host copy started, its check deferred."""
        grads = self._master_grads()
        norm = HostScalar(self._global_norm_tensor(grads))
        if self.sharded is not None:
            self.sharded.step(grads)
        else:
            self.inner.step()
        self.steps += 1
        self._pending = (self.steps, norm)
        return StepReport(norm, False, None, check=self.check_pending)

    def master_tensors(self) -> list[torch.Tensor]:
        """The separate fp32 master tensors (empty when the masters are the parameters)."""
        return self.sharded.master_tensors() if self.sharded is not None else []

    def flush(self) -> None:
        """ZeRO-Offload's one-step-delayed update: finish the host update in flight and
        put its weights in the model (checkpoints call it; a no-op otherwise)."""
        if self.sharded is not None and self.sharded.host is not None:
            self.sharded.zero.wait_params()  # a gather in flight would overwrite the shards
            if self.sharded.host.flush():
                self.sharded.zero.sync_params()

    def close(self) -> None:
        """Stop ZeRO-Offload's host worker (call :meth:`flush` first to keep a pending
        delayed update). A no-op without offload."""
        if self.sharded is not None and self.sharded.host is not None:
            self.sharded.host.close()

    @torch.no_grad()
    def publish_masters(self) -> None:
        """After the masters were written in place (a checkpoint load): copy them into
        the model's shards and make the parameters whole again (ZeRO-1/2's all-gather),
        as the end of :meth:`step` does; nothing to do without sharded masters."""
        if self.sharded is None:
            return
        self.flush()
        for slot in self.sharded.slots:
            if not slot.alias:
                self.sharded.zero.param_shard(slot.unit).copy_(slot.master)
        self.sharded.zero.sync_params()

    def local_pieces(self) -> list[LocalPiece]:
        """The model's pieces (:meth:`OptimizerTarget.local_pieces`) that this optimizer
        steps, each with its master values (``value``) and the key of its optimizer
        state (``key``), and the frozen parameters' pieces as the model describes them
        (no state): what a checkpoint saves and restores."""
        self.flush()
        pieces = self.target.local_pieces()
        frozen = [p for p in pieces if not p.key.requires_grad]  # saved, not stepped
        if self.sharded is not None:
            described = [self.sharded.describe(p) for p in pieces if p.key.requires_grad]
            return [p for p in described if p is not None] + frozen
        mine = {id(p) for p in self._params}
        return [p for p in pieces if id(p.key) in mine] + frozen

    # ------------------------------------------------------------------ pieces

    def _master_grads(self) -> list[torch.Tensor]:
        """fp32 gradients on the master device, one per slot (ZeRO) or parameter."""
        if self.sharded is not None:
            return self.sharded.grads()
        return [p.grad for p in self._params if p.grad is not None]

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        """:meth:`_global_norm_tensor` read on the host (one sync on a GPU)."""
        return float(self._global_norm_tensor(grads).item())

    def _global_norm_tensor(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """L2 norm over every element of the model, each counted once: the weighted local
        squared norm, summed over the norm groups; a float64 scalar on the device."""
        # the collective runs where the gradients live (NCCL cannot reduce CPU tensors)
        device = (
            self.zero.device
            if self.zero is not None
            else next((p.device for p in self._params), torch.device("cpu"))
        )
        if self.sharded is not None:
            pieces, weights = self.sharded.norm_pieces(grads, self.target.norm_weight)
        else:
            held = [p for p in self._params if p.grad is not None]
            pieces = [p.grad for p in held if p.grad is not None]
            weights = [self.target.norm_weight(p) for p in held]
        if pieces:
            # per-tensor norms, fp32 at least (offload: bf16 reduced shards on the device)
            low = any(is_low_precision(p.dtype) for p in pieces)
            norms = torch._foreach_norm(pieces, 2, dtype=torch.float32 if low else None)
            sq64 = torch.stack([n.to(device, torch.float64) for n in norms]).pow(2)
            if any(w != 1.0 for w in weights):
                sq64 = sq64 * torch.tensor(weights, dtype=torch.float64, device=device)
            sq = sq64.sum()
        else:
            sq = torch.zeros((), dtype=torch.float64, device=device)
        if self._groups:
            sq = sq.reshape(1)
            for group in self._groups:
                comm.all_reduce(sq, group, op="sum")
        return sq.sqrt().reshape(())
