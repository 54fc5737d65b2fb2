"""The optimizer side of ZeRO: sharded fp32 masters, global-norm clipping, loss scaling.

:class:`ZeroOptimizer` wraps any element-wise ``torch.optim`` optimizer (AdamW, Adam, SGD
with momentum, ...). Given a :class:`~plait.parallel.zero.ZeroDataParallel` model it
rebuilds the optimizer over this rank's *shards*: for every unit, the fp32 master copy
of the rank's ``1/F`` slice of the flat parameters, cut at parameter boundaries into
segments so each segment keeps the hyper-parameters (learning rate, weight decay) of the
param group its parameter was in. Optimizer state is therefore allocated for the shard
only (ZeRO-1, Rajbhandari et al. 2020). With fp32 parameters and no offload the masters
*are* the parameter shards (no copy); with bf16/fp16 parameters they are separate fp32
tensors initialised from the exact fp32 weights; with offload they live on the CPU, the
gradient shards are copied there, the step runs there and the result is copied back.

One :meth:`ZeroOptimizer.step`:

1. master gradients = reduced gradient shards in fp32, divided by the loss scale;
2. the global L2 norm: squared norms of the local shards summed over the shard group
   (replicas of a shard are identical after the reduction, so the shard group covers
   every element exactly once) and over the tensor-parallel axis: a TP shard counts
   fully, a tensor held identically by k tp ranks (replicated norms, replicated
   key/value heads; :func:`plait.parallel.tensor.layers.shard_info`) counts 1/k on each;
3. a non-finite norm (or loss) skips the step: fp16 backs the loss scale off; fp32/bf16
   warn or raise according to the policy. A skipped step touches neither weights nor
   optimizer state;
4. clipping by ``max_norm / (norm + 1e-6)`` (torch's formula), the inner step, the copy
   of the masters back into the model dtype, and (stages 1/2) the all-gather of the
   updated shards.

Any other model (``DataParallel`` or a plain module) gets the same steps on whole
parameters, which must then be fp32 or fp64 (they are their own masters).

ZeRO composes with tensor parallelism: the model's parameters may be TP shards (ZeRO
flattens whatever local tensors the module holds and reduces over the dp axis only);
only the norm needs the tp axis, as above.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from plait import comm
from plait.comm import AxisGroup
from plait.parallel.precision import DynamicLossScaler, NonFiniteError, is_low_precision
from plait.parallel.tensor.layers import shard_info
from plait.parallel.zero import ZeroDataParallel
from plait.parallel.zero.flat import FlatUnit

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]

_NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "SparseAdam")


@dataclass
class StepReport:
    """What one optimizer step did."""

    grad_norm: float  # global L2 norm before clipping (after unscaling)
    skipped: bool
    loss_scale: float | None  # the scale the step's loss was multiplied by (fp16)
    reason: str = ""


@dataclass
class _Slot:
    """One unit's shard as the inner optimizer sees it."""

    unit: FlatUnit
    master: torch.Tensor  # (shard_numel,) fp32 (or the fp32/fp64 parameter shard itself)
    alias: bool  # master is the model's parameter shard (no copy back needed)
    segments: list[tuple[nn.Parameter, int, int]]  # optimizer params = master[start:end]
    norm_pieces: list[tuple[int, int, float]]  # (start, end, weight) of every parameter piece


def _rebuild(
    optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """A fresh optimizer of ``optimizer``'s class and defaults over ``groups``."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return cls(groups, **kwargs)


class ZeroOptimizer:
    """Wrap ``optimizer`` for ``model`` (see the module docstring).

    Args:
        model: a :class:`ZeroDataParallel` (sharded masters) or any other module whose
            gradients are already complete on every rank (``DataParallel``, one process).
        optimizer: a ``torch.optim`` optimizer built over ``model``'s parameters (its
            param groups and defaults are copied; it must not have stepped yet), or a
            factory ``groups -> optimizer`` called with one group of every segment.
        max_norm: clip gradients to this global L2 norm (0: no clipping).
        scaler: the dynamic loss scaler (fp16).
        nonfinite: "error" (raise :class:`NonFiniteError`) or "skip" (warn) when the
            loss or gradient norm is not finite and no scaler is in use.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        *,
        max_norm: float = 0.0,
        scaler: DynamicLossScaler | None = None,
        nonfinite: Literal["error", "skip"] = "error",
    ) -> None:
        if max_norm < 0:
            raise ValueError(f"max_norm must not be negative, got {max_norm}")
        if nonfinite not in ("error", "skip"):
            raise ValueError(f"nonfinite must be 'error' or 'skip', got {nonfinite!r}")
        if isinstance(optimizer, torch.optim.Optimizer):
            if type(optimizer).__name__ in _NOT_ELEMENTWISE:
                raise TypeError(
                    f"{type(optimizer).__name__} needs whole parameters; ZeroOptimizer "
                    "shards flat parameters and supports element-wise optimizers only"
                )
            if any(optimizer.state.values()):
                raise ValueError("wrap the optimizer before its first step (it has state)")
        self.model = model
        self.max_norm = max_norm
        self.scaler = scaler
        self.nonfinite = nonfinite
        self.steps = 0
        self.skipped = 0
        self.zero = model if isinstance(model, ZeroDataParallel) else None
        self.slots: list[_Slot] = []
        if self.zero is not None:
            self.inner = self._build_sharded(self.zero, optimizer)
        else:
            params = [p for p in model.parameters() if p.requires_grad]
            low = [p for p in params if is_low_precision(p.dtype)]
            if low:
                raise TypeError(
                    "16-bit parameters need fp32 master weights: wrap the model in "
                    "ZeroDataParallel (stage 0 replicates, as plain data parallelism does)"
                )
            if isinstance(optimizer, torch.optim.Optimizer):
                self.inner = optimizer
            else:
                self.inner = optimizer([{"params": params}])
            self._params = [p for g in self.inner.param_groups for p in g["params"]]

    # ------------------------------------------------------------------ set-up

    def _build_sharded(
        self, zero: ZeroDataParallel, optimizer: torch.optim.Optimizer | OptimizerFactory
    ) -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer):
            base = optimizer.param_groups
        else:
            base = [{"params": [p for u in zero.units for p in u.params]}]
        group_of: dict[nn.Parameter, int] = {}
        for gi, g in enumerate(base):
            for p in g["params"]:
                group_of[p] = gi
        groups: list[dict[str, Any]] = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in base
        ]
        offload = zero.offload != "none"
        master_device = torch.device("cpu") if offload else zero.device
        for u in zero.units:
            shard = zero.param_shard(u)  # (shard_numel,) model dtype
            alias = not offload and not is_low_precision(shard.dtype)
            if alias:
                master = shard
            else:
                init = u.fp32_init if u.fp32_init is not None else shard
                wide = torch.float64 if shard.dtype == torch.float64 else torch.float32
                master = init.to(master_device, wide, copy=True)  # (shard_numel,)
            u.fp32_init = None
            segments = []
            pieces = [(a, b, self._norm_weight(u.params[i])) for i, a, b in u.local_segments()]
            for i, start, end in u.local_segments():
                group = group_of.get(u.params[i])
                if group is None:
                    continue
                seg = nn.Parameter(master[start:end])  # shares the master's storage
                groups[group]["params"].append(seg)
                segments.append((seg, start, end))
            self.slots.append(_Slot(u, master, alias, segments, pieces))
        if isinstance(optimizer, torch.optim.Optimizer):
            return _rebuild(optimizer, groups)
        return optimizer(groups)

    # ------------------------------------------------------------------ API

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (set ``lr`` here)."""
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        """The inner optimizer's state (for the shards only under ZeRO)."""
        return self.inner.state

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward()`` on: multiplied by the loss scale under fp16."""
        return self.scaler.scale_loss(loss) if self.scaler is not None else loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (ZeRO: zero the gradient buffers and shards)."""
        if self.zero is not None:
            self.zero.zero_grad()
        else:
            self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, loss_finite: bool = True) -> StepReport:
        """Unscale, measure the global norm, skip or clip, step, write back (see above)."""
        scale = self.scaler.scale if self.scaler is not None else None
        grads = self._master_grads()
        if scale is not None:
            torch._foreach_mul_(grads, 1.0 / scale)
        norm = self._global_norm(grads)
        if not (math.isfinite(norm) and loss_finite):
            what = "loss" if not loss_finite else "gradient norm"
            self.skipped += 1
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
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
        if self.zero is None:
            self.inner.step()
        else:
            for slot, g in zip(self.slots, grads, strict=True):
                for seg, start, end in slot.segments:
                    seg.grad = g[start:end]
            self.inner.step()
            for slot in self.slots:
                for seg, _, _ in slot.segments:
                    seg.grad = None
                if not slot.alias:
                    self.zero.param_shard(slot.unit).copy_(slot.master)
            self.zero.sync_params()
        if self.scaler is not None:
            self.scaler.update(found_inf=False)
        self.steps += 1
        return StepReport(norm, False, scale)

    # ------------------------------------------------------------------ pieces

    def _master_grads(self) -> list[torch.Tensor]:
        """fp32 gradients on the master device, one per slot (ZeRO) or parameter."""
        if self.zero is None:
            return [p.grad for p in self._params if p.grad is not None]
        out = []
        for slot in self.slots:
            g = self.zero.reduced_grad(slot.unit)  # (shard_numel,) reduce dtype
            out.append(g.to(slot.master.device, slot.master.dtype))  # copy if they differ
        return out

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        """L2 norm over every shard of every rank (each element counted once): the local
        squared norm, summed over the shard group and the tensor-parallel axis."""
        # the collective runs where the gradients live (NCCL cannot reduce CPU tensors)
        device = (
            self.zero.device
            if self.zero is not None
            else next((p.device for p in self._params), torch.device("cpu"))
        )
        pieces: list[torch.Tensor] = []
        weights: list[float] = []
        if self.zero is None:
            for p in self._params:
                if p.grad is not None:
                    pieces.append(p.grad)
                    weights.append(self._norm_weight(p))
        else:
            for slot, g in zip(self.slots, grads, strict=True):
                if all(w == 1.0 for _, _, w in slot.norm_pieces):
                    pieces.append(g)  # the whole shard (its padding holds zeros)
                    weights.append(1.0)
                else:
                    for a, b, w in slot.norm_pieces:
                        pieces.append(g[a:b])
                        weights.append(w)
        if pieces:
            norms = torch._foreach_norm(pieces)  # per-tensor norms, fp32
            sq64 = torch.stack([n.to(device, torch.float64) for n in norms]).pow(2)
            if any(w != 1.0 for w in weights):
                sq64 = sq64 * torch.tensor(weights, dtype=torch.float64, device=device)
            sq = sq64.sum()
        else:
            sq = torch.zeros((), dtype=torch.float64, device=device)
        groups = self._norm_groups()
        if groups:
            sq = sq.reshape(1)
            for group in groups:
                comm.all_reduce(sq, group, op="sum")
        return float(sq.sqrt().item())

    def _norm_weight(self, p: torch.Tensor) -> float:
        """Weight of ``p``'s squared gradient norm in a norm summed over the tp axis: 1, or
        1/k for a tensor held identically by k tp ranks (:class:`plait.parallel.tensor.layers.
        TPShard`). Called while the ZeRO slots are built (in ``__init__``) and per step."""
        info = shard_info(p)
        return info.norm_weight if info is not None else 1.0

    def _norm_groups(self) -> list[AxisGroup]:
        """The groups the local squared norm is summed over, in order: the ZeRO shard
        group, then the tensor-parallel group (each only when it has several ranks)."""
        groups = []
        if self.zero is not None and self.zero.shard_group.size > 1:
            groups.append(self.zero.shard_group)  # the ZeRO shards of the replica
        tp = self._tp_group()
        if tp is not None and tp.size > 1:
            groups.append(tp)  # the tensor-parallel pieces
        return groups

    def _tp_group(self) -> AxisGroup | None:
        """The tensor-parallel group the norm also sums over: the tp axis of the wrapped
        model's mesh (``DataParallel`` and ``ZeroDataParallel`` carry it) when it spans
        more than one rank; None otherwise."""
        mesh = getattr(self.model, "mesh", None)
        return mesh.axis("tp") if mesh is not None and mesh.size("tp") > 1 else None

    def master_tensors(self) -> list[torch.Tensor]:
        """The separate fp32 master tensors (empty when the masters are the parameters)."""
        return [s.master for s in self.slots if not s.alias]
