"""ZeRO stages 0-3 (fully sharded data parallelism) over the data-parallel axis.

Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models") partition the training state of data parallelism across the N ranks of a
group instead of replicating it; Zhao et al. 2023 ("PyTorch FSDP") describe the
unit-by-unit gather/free schedule of stage 3. :class:`ZeroDataParallel` implements:

* **stage 0** — everything replicated, gradients all-reduced (plain DP; used by
  ``parallelize`` for 16-bit parameters, whose fp32 masters the optimizer wrapper holds).
* **stage 1** — full parameters and full gradients on every rank (gradients accumulate
  locally under ``no_sync``); in the synchronising backward each unit's gradient is
  reduce-scattered once it is complete, each rank updates only its shard (optimizer
  state and fp32 masters for 1/N of the parameters) and the updated shards are
  all-gathered. Bytes/param with bf16 + Adam: 2 + 2 + 12/N.
* **stage 2** — as 1, but only the gradient shard is kept: a unit's gradients are copied
  into a transient buffer and reduce-scattered (asynchronously) the moment backward has
  produced all of them, on every micro-step; at most
  ``GradientReducer.MAX_REDUCES_IN_FLIGHT`` + 1 such buffers exist at once. 2 + 14/N.
* **stage 3** — parameters are sharded too: a unit is all-gathered just before its
  forward (the next unit's gather is started meanwhile: prefetch), freed after it
  (``reshard_after_forward``), gathered again before its backward (triggered by a hook
  on its output's gradient) and freed once its gradients are reduce-scattered: 16/N.

Hybrid sharding (``zero_shard_size`` F): shard inside groups of F consecutive dp ranks and
all-reduce the shards across the dp/F groups; F = 1 replicates, F = dp fully shards.
Units, flattening and padding: :mod:`plait.parallel.zero.flat`. The gradient path
inside backward (hooks, reduce-scatter, hybrid all-reduce, one state machine per unit):
:class:`plait.parallel.zero.reduce.GradientReducer`, which the wrapper owns. The
optimizer side (sharded fp32 masters, offload):
:class:`plait.parallel.zero.optim.ShardedMasters`, stepped by :class:`plait.optim.Optimizer`
(global-norm clipping, loss scaling).

The module may already be split by tensor parallelism (:mod:`plait.parallel.tensor.plan`):
its parameters are then the local TP shards, which ZeRO flattens like any other tensor;
every collective here runs on the ``axis`` (dp) groups only.

Gathered storage is freed with ``untyped_storage().resize_(0)``: autograd's saved views of
a parameter keep pointing at the same storage, which is refilled before backward, while
the parameter itself is swapped to an empty tensor so stray reads fail loudly.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn

from plait import comm
from plait.comm import Handle
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.parallel.data import broadcast_module_state
from plait.parallel.precision import parse_dtype
from plait.parallel.zero.flat import ROOT, FlatUnit, WrapSpec, plan_units
from plait.parallel.zero.reduce import GradientReducer
from plait.pieces import LocalPiece

Offload = Literal["none", "optimizer", "params"]


class Gather(enum.Enum):
    """Where a stage-3 unit's full parameters stand."""

    FREE = "free"
    """Only the shard is held; the parameters are empty tensors."""
    GATHERING = "gathering"
    """The all-gather is in flight (a prefetch)."""
    GATHERED = "gathered"
    """The full parameters are in place."""


_FREE, _GATHERING, _GATHERED = Gather.FREE, Gather.GATHERING, Gather.GATHERED


def _tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensor_leaves(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensor_leaves(o)]
    return []


class ZeroDataParallel(nn.Module):
    """Wrap ``module`` for ZeRO stage ``stage`` over ``mesh``'s ``axis`` (default "dp").

    Args:
        module: any ``nn.Module`` (fp32 parameters; they are cast to ``param_dtype``).
        mesh: the device mesh.
        stage: 0, 1, 2 or 3 (see the module docstring).
        zero_shard_size: hybrid sharding factor F (default: the axis degree; stage 0: 1).
        wrap: unit policy (None, module classes, or ``(name, module) -> bool``).
        reshard_after_forward: stage 3: free a unit after its forward.
        prefetch: stage 3: gather the next unit while the current one computes.
        param_dtype: dtype of the parameters and compute (default: unchanged).
        reduce_dtype: dtype gradients are reduced in (default: ``param_dtype``).
        offload: "optimizer" (masters and optimizer state on the CPU) or "params"
            (stage 3: also the parameter shards); needs stage >= 1.
        find_unused_parameters: treat missing gradients as zeros instead of raising.
        record_events: keep :attr:`events` (gathers, frees, reductions) of the last step.
        axis: the mesh axis to shard over.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh,
        stage: int = 3,
        *,
        zero_shard_size: int | None = None,
        wrap: WrapSpec = None,
        reshard_after_forward: bool = True,
        prefetch: bool = True,
        param_dtype: torch.dtype | str | None = None,
        reduce_dtype: torch.dtype | str | None = None,
        offload: Offload = "none",
        find_unused_parameters: bool = False,
        record_events: bool = False,
        axis: str = "dp",
    ) -> None:
        super().__init__()
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        dp = mesh.size(axis)
        if stage == 0 and zero_shard_size not in (None, 1):
            raise ConfigError("ZeRO stage 0 replicates everything: zero_shard_size must be 1")
        factor = 1 if stage == 0 else (zero_shard_size or dp)
        if offload not in ("none", "optimizer", "params"):
            raise ConfigError(f"offload must be none, optimizer or params, got {offload!r}")
        if offload != "none" and stage == 0:
            raise ConfigError("offload needs ZeRO stage >= 1")
        if offload == "params" and stage != 3:
            raise ConfigError("offload='params' needs ZeRO stage 3")
        trainable = [p for p in module.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("ZeroDataParallel needs a module with a trainable parameter")
        self.module = module
        self.mesh = mesh
        self.stage = stage
        self.offload: Offload = offload
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.find_unused_parameters = find_unused_parameters
        self.record_events = record_events
        self.events: list[tuple[str, str]] = []
        self.device = trainable[0].device
        self.param_dtype = parse_dtype(param_dtype) if param_dtype else trainable[0].dtype
        self.reduce_dtype = parse_dtype(reduce_dtype) if reduce_dtype else self.param_dtype
        self.dp_group = mesh.axis(axis)
        self.shard_group, self.replicate_group = mesh.split_axis(axis, factor)
        self._broadcast_state()
        specs = plan_units(module, wrap)
        self.units = [FlatUnit(i, s, factor, self.shard_group.index) for i, s in enumerate(specs)]
        self._empty: dict[nn.Parameter, torch.Tensor] = {}
        self._state: dict[int, Gather] = {}
        self._pending_gather: dict[int, tuple[torch.Tensor, Handle]] = {}
        self._pre_backward_done: set[int] = set()
        self._order: list[FlatUnit] = list(self.units)  # forward order (recorded)
        self._order_now: list[FlatUnit] = []
        self.gathered_bytes = 0  # stage 3: gathered parameter bytes now, and the peaks
        self.peak_gathered_bytes = 0
        self.peak_gathered_units = 0
        self.reducer = GradientReducer(
            self.units,
            stage,
            self.shard_group,
            self.replicate_group,
            self.reduce_dtype,
            self.device,
            find_unused_parameters,
            release=self._free,
            on_finish=self._after_backward,
            note=self._note_event,
        )
        for u in self.units:
            self._init_unit(u)
        # Units freed after their forward and re-gathered for their backward: every
        # wrapped unit, and the root unit when one module (not the root itself) uses it.
        # A root unit used by several modules (tied weights) stays gathered from its first
        # use in forward until its gradients are reduced.
        self._reshardable = {
            u.index
            for u in self.units
            if u.name != ROOT or (len(u.triggers) == 1 and u.triggers[0] is not module)
        }
        self._hooks: list[Any] = []
        for u in self.units:
            for i, p in enumerate(u.params):
                hook = functools.partial(self.reducer.on_grad, u, i)
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))
            if stage == 3:
                for m in u.triggers:
                    self._hooks.append(
                        m.register_forward_pre_hook(functools.partial(self._pre_forward, u))
                    )
                    if u.index in self._reshardable:
                        self._hooks.append(
                            m.register_forward_hook(functools.partial(self._post_forward, u))
                        )

    # ------------------------------------------------------------------ set-up

    def _broadcast_state(self) -> None:
        broadcast_module_state(self.module, self.dp_group)

    @torch.no_grad()
    def _init_unit(self, u: FlatUnit) -> None:
        # (padded,) the exact initial values (fp64 parameters stay fp64), zero padding
        wide = torch.float64 if any(p.dtype == torch.float64 for p in u.params) else torch.float32
        flat = u.flatten(wide)
        if self.param_dtype in (torch.bfloat16, torch.float16):
            u.fp32_init = flat[u.lo : u.hi].float()  # (shard,) initial fp32 masters (a copy)
        u.full = flat.to(self.param_dtype) if self.param_dtype != wide else flat
        for p in u.params:
            self._empty[p] = torch.empty((0,) * p.dim(), dtype=self.param_dtype, device=p.device)
        if self.stage == 3:
            dev = torch.device("cpu") if self.offload == "params" else self.device
            u.shard = u.full[u.lo : u.hi].clone().to(dev)  # (shard,) the persistent shard
            self._state[u.index] = _GATHERED
            self._free(u, count=False)
        else:
            for i, p in enumerate(u.params):
                p.data = u.view(i, u.full)
        if self.stage <= 1:
            u.grad_full = torch.zeros(u.padded, dtype=self.param_dtype, device=self.device)
            for i, p in enumerate(u.params):
                p.grad = u.view(i, u.grad_full)
        else:
            u.grad_shard = torch.zeros(u.shard_numel, dtype=self.reduce_dtype, device=self.device)

    # ------------------------------------------------------------------ gather / free

    def _note(self, kind: str, u: FlatUnit) -> None:
        self._note_event(kind, u.name)

    def _note_event(self, kind: str, name: str) -> None:
        if self.record_events:
            self.events.append((kind, name))

    def _after_backward(self) -> None:
        """End of a synchronising backward (the reducer's callback): stage 3 frees every
        unit; the next backward gathers again."""
        self._pre_backward_done.clear()
        if self.stage == 3:
            self._free_all()

    @property
    def grad_buffer_bytes(self) -> int:
        """Stages 2/3: bytes of the transient full-gradient buffers alive now."""
        return self.reducer.grad_buffer_bytes

    @property
    def peak_grad_buffer_bytes(self) -> int:
        """Stages 2/3: the most transient gradient-buffer bytes alive at once."""
        return self.reducer.peak_grad_buffer_bytes

    def _start_gather(self, u: FlatUnit) -> None:
        """Launch the all-gather of ``u``'s shards (asynchronously)."""
        if self._state[u.index] != _FREE:
            return
        assert u.shard is not None
        src = u.shard if u.shard.device == self.device else u.shard.to(self.device)
        out, h = comm.all_gather(src, self.shard_group, async_op=True)  # (padded,)
        self._pending_gather[u.index] = (out, h)
        self._state[u.index] = _GATHERING
        self.gathered_bytes += u.padded * out.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        live = sum(1 for s in self._state.values() if s != _FREE)
        self.peak_gathered_units = max(self.peak_gathered_units, live)
        self._note("gather", u)

    def _ensure_gathered(self, u: FlatUnit) -> None:
        """Block until ``u``'s full parameters are in place (gathering if needed)."""
        if self._state[u.index] == _GATHERED:
            return
        self._start_gather(u)
        out, h = self._pending_gather.pop(u.index)
        h.wait()
        u.full.untyped_storage().resize_(u.padded * u.full.element_size())
        u.full.copy_(out)
        for i, p in enumerate(u.params):
            p.data = u.view(i, u.full)
        self._state[u.index] = _GATHERED

    def _free(self, u: FlatUnit, count: bool = True) -> None:
        """Release ``u``'s gathered storage; its parameters become empty tensors."""
        state = self._state[u.index]
        if state == _FREE:
            return
        if state == _GATHERING:
            self._pending_gather.pop(u.index)[1].wait()
        u.full.untyped_storage().resize_(0)
        for p in u.params:
            p.data = self._empty[p]
        self._state[u.index] = _FREE
        if count:
            self.gathered_bytes -= u.padded * u.full.element_size()
            self._note("free", u)

    def _free_all(self) -> None:
        for u in self.units:
            self._free(u)

    @staticmethod
    def _in_autograd() -> bool:
        """Whether the autograd engine is executing (a recomputation inside backward)."""
        return bool(torch._C._current_graph_task_id() != -1)

    # ------------------------------------------------------------------ stage-3 hooks

    def _pre_forward(self, u: FlatUnit, module: nn.Module, args: Any) -> None:
        if self._in_autograd():
            self._ensure_gathered(u)
            return
        if all(v is not u for v in self._order_now):
            self._order_now.append(u)
        self._ensure_gathered(u)
        if self.prefetch:
            order = self._order
            k = next((j for j, v in enumerate(order) if v is u), -1)
            if 0 <= k < len(order) - 1:
                self._start_gather(order[k + 1])

    def _post_forward(self, u: FlatUnit, module: nn.Module, args: Any, output: Any) -> None:
        if self._in_autograd():
            return
        if not torch.is_grad_enabled():
            self._free(u)
            return
        if self.reshard_after_forward:
            self._free(u)
        for t in _tensor_leaves(output):
            if t.requires_grad:
                t.register_hook(functools.partial(self._pre_backward, u))

    def _pre_backward(self, u: FlatUnit, grad: torch.Tensor) -> None:
        self.reducer.begin_backward()
        if u.index in self._pre_backward_done:
            return
        self._pre_backward_done.add(u.index)
        self._ensure_gathered(u)
        if self.prefetch:
            order = self._order
            k = next((j for j, v in enumerate(order) if v is u), -1)
            for v in reversed(order[:k] if k > 0 else []):
                if v.index not in self._pre_backward_done and v.index in self._reshardable:
                    self._start_gather(v)  # no-op if it is still gathered
                    break

    # ------------------------------------------------------------------ API

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (stage 3 gathers units on demand)."""
        if self.record_events and not self.reducer.in_backward:
            self.events = []
        self._order_now = []
        out = self.module(*args, **kwargs)
        if self.stage == 3:
            if self._order_now:
                self._order = self._order_now
            if not (torch.is_grad_enabled() and any(t.requires_grad for t in _tensor_leaves(out))):
                self._free_all()
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stages 0/1: accumulate full gradients locally with no communication. Stages 2/3
        keep only gradient shards and reduce-scatter on every backward regardless."""
        old = self.reducer.sync
        self.reducer.sync = False
        try:
            yield
        finally:
            self.reducer.sync = old

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Stage 3: hold every unit's full parameters inside the block (e.g. to read the
        weights); other stages hold them always."""
        if self.stage == 3:
            for u in self.units:
                self._ensure_gathered(u)
        try:
            yield
        finally:
            if self.stage == 3:
                self._free_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers (stage 0/1: ``.grad`` stays a view into them)."""
        self.reducer.reset()
        for u in self.units:
            if self.stage <= 1:
                assert u.grad_full is not None
                u.grad_full.zero_()
                for i, p in enumerate(u.params):
                    view = u.view(i, u.grad_full)
                    if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view
            else:
                assert u.grad_shard is not None
                u.grad_shard.zero_()

    def param_shard(self, u: FlatUnit) -> torch.Tensor:
        """``(shard_numel,)`` this rank's piece of ``u``'s parameters (model dtype)."""
        if self.stage == 3:
            assert u.shard is not None
            return u.shard
        return u.full[u.lo : u.hi]

    def reduced_grad(self, u: FlatUnit) -> torch.Tensor:
        """``(shard_numel,)`` the averaged gradient of this rank's shard (zeros if none)."""
        if self.stage >= 2:
            assert u.grad_shard is not None
            return u.grad_shard
        g = self.reducer.reduced(u)
        if g is None:
            return torch.zeros(u.shard_numel, dtype=self.reduce_dtype, device=self.device)
        return g

    @torch.no_grad()
    def sync_params(self) -> None:
        """Stages 1/2 after an optimizer step: all-gather the updated shards so every
        rank holds the full parameters again (stage 3 gathers at the next forward)."""
        if self.stage == 3 or self.shard_group.size == 1:
            return
        pending = []
        for u in self.units:
            out, h = comm.all_gather(u.full[u.lo : u.hi], self.shard_group, async_op=True)
            pending.append((u, out, h))
        for u, out, h in pending:
            h.wait()
            u.full.copy_(out)

    def local_pieces(self) -> list[LocalPiece]:
        """This rank's runs of each parameter in its shards, named as in ``module``: a
        unit's shard ``[lo, hi)`` of the flat, padded parameters covers runs of one or more
        parameters (padding left out). Replicas of a shard (hybrid sharding) are equal
        after the step, so only the first replicate rank writes."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        first = self.replicate_group.index == 0
        out: list[LocalPiece] = []
        for u in self.units:
            shard = self.param_shard(u)  # (shard_numel,) model dtype
            for i, a, b in u.local_segments():
                p, at = u.params[i], u.lo + a - u.offsets[i]  # at: first element in p
                name, shape, run = names[id(p)], list(u.shapes[i]), shard[a:b]
                out.append(
                    LocalPiece(name, shape, None, at, at + b - a, run, p, self.param_dtype, first)
                )
        return out

    def reset_peak_gathered(self) -> None:
        """Restart the peak counters (gathered bytes/units, gradient buffers)."""
        self.reducer.peak_grad_buffer_bytes = self.reducer.grad_buffer_bytes
        self.peak_gathered_bytes = self.gathered_bytes
        self.peak_gathered_units = sum(1 for s in self._state.values() if s != _FREE)

    def unit_summary(self) -> list[tuple[str, int, int, int]]:
        """``(name, parameters, numel, padded numel)`` of every unit."""
        return [(u.name, len(u.params), u.numel, u.padded) for u in self.units]
