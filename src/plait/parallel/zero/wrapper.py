"""ZeRO stages 0-3 (fully sharded data parallelism) over the data-parallel axis.

Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models") partition the training state of data parallelism across the N ranks of a
group instead of replicating it; Zhao et al. 2023 ("PyTorch FSDP") describe the
unit-by-unit gather/free schedule of stage 3. :class:`ZeroDataParallel` implements:

* **stage 0** — everything replicated, gradients all-reduced (plain DP; used by
  ``parallelize`` for 16-bit parameters, whose fp32 masters the optimizer wrapper holds).
* **stage 1** — full parameters and full gradients on every rank (gradients accumulate
  locally under ``no_sync``); in the synchronising backward each unit's gradient is
  reduce-scattered from a backward hook the moment it is complete (overlapping the rest
  of backward; nothing waits for it until the end of backward), each rank updates only
  its shard (optimizer state and fp32 masters for 1/N of the parameters) and the updated
  shards are all-gathered. Bytes/param with bf16 + Adam: 2 + 2 + 12/N.
* **stage 2** — as 1, but only the gradient shard is kept: a unit's gradients are copied
  into a transient buffer and reduce-scattered (asynchronously) the moment backward has
  produced all of them, on every micro-step; at most
  ``GradientReducer.MAX_REDUCES_IN_FLIGHT`` + 1 such buffers exist at once. 2 + 14/N.

  Stages 1/2, after the step: :meth:`ZeroDataParallel.sync_params` *launches* the
  all-gathers of the updated shards (one per unit, or per bucket with ``bucket_mb``:
  :mod:`plait.parallel.zero.bucket`) and returns; each unit's gather is completed just
  before the unit's next forward (a forward pre-hook),
  so the gathers overlap the optimizer step's tail and the forward of earlier units.
  Anything that reads the full parameters through the wrapper completes them first
  (:meth:`~ZeroDataParallel.gathered`, :meth:`~ZeroDataParallel.local_pieces`,
  ``state_dict``, the next optimizer step); code that reads ``module``'s parameters
  directly between a step and the next forward calls
  :meth:`~ZeroDataParallel.wait_params` (or uses ``gathered()``).
* **stage 3** — parameters are sharded too: a unit is all-gathered just before its
  forward (the next unit's gather is started meanwhile: prefetch), freed after it
  (``reshard_after_forward``), gathered again before its backward (triggered by a hook
  on its output's gradient) and freed once its gradients are reduce-scattered: 16/N.
  The gather/free path, one state machine per unit:
  :class:`plait.parallel.zero.gather.ParameterGatherer`, which the wrapper owns.

Hybrid sharding (``zero_shard_size`` F): shard inside groups of F consecutive dp ranks and
all-reduce the shards across the dp/F groups; F = 1 replicates, F = dp fully shards.
Units, flattening and padding: :mod:`plait.parallel.zero.flat`. The gradient path
inside backward (reduce-scatter, hybrid all-reduce, one state machine per unit):
:class:`plait.parallel.zero.reducer.GradientReducer`, which the wrapper owns. One driver,
chosen once at construction (``driver``), sequences the gathers and reductions handed to
it as :attr:`ZeroDataParallel.drive` (:mod:`plait.parallel.zero.drive`): the autograd
hooks (:class:`plait.parallel.zero.driver.AutogradDriver`, :attr:`ZeroDataParallel.driver`)
or, under pipeline parallelism, the schedule (no hook installed). The
optimizer side (sharded fp32 masters, offload):
:class:`plait.parallel.zero.optim.ShardedMasters`, stepped by :class:`plait.optim.Optimizer`
(global-norm clipping, loss scaling).

The module may already be split by tensor parallelism (:mod:`plait.parallel.tensor.sharding_plan`):
its parameters are then the local TP shards, which ZeRO flattens like any other tensor;
every collective here runs on the ``axis`` (dp) groups only.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from plait.comm import AxisGroup
from plait.config import OFFLOADS, ZERO_MEANING, ZERO_STAGES, Offload
from plait.config.rules.choices import check_choice, check_positive
from plait.config.rules.features import check_offload
from plait.config.rules.layout import check_shard_size
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.parallel.data_parallel import broadcast_module_state
from plait.parallel.materialize import give_storage, unallocated
from plait.parallel.precision import parse_dtype
from plait.parallel.tensor.layers import tp_norm_weight
from plait.parallel.zero.bucket import ParamSync
from plait.parallel.zero.drive import SCHEDULE_STAGES, ZERO_DRIVERS, ZeroDrive, ZeroDriver
from plait.parallel.zero.driver import AutogradDriver
from plait.parallel.zero.experts import expert_unit_groups, local_experts_as_they_are, make_units
from plait.parallel.zero.flat import FlatUnit, WrapSpec, plan_units
from plait.parallel.zero.gather import ParameterGatherer
from plait.parallel.zero.reducer import GradientReducer
from plait.pieces import LocalPiece


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
        axis: the mesh axis to shard over, or a combination of axes whose ranks hold
            the same parameters (``("dp", "cp")`` under context parallelism).
        bucket_mb: stages 1/2: reduce-scatter the gradients, and all-gather the updated
            parameters, of consecutive units together in buckets of at least this many
            MiB (as DataParallel's ``bucket_mb``); None: one collective per unit.
        init: for a module whose trainable parameters are on the meta device: a
            parameter's full local initial value (CPU; :class:`~plait.parallel.
            materialize.LocalInit`). Each unit's flat buffer (stage 3: only this rank's
            shard) is then filled one parameter at a time on the mesh's device, and
            nothing is broadcast (the values are the same on every rank by
            construction); buffers and frozen parameters must already have storage.
        offload_dir: with offload: keep the optimizer state (with "params" also the fp32
            masters) in files in this folder (ZeRO-Infinity's NVMe tier).
        offload_delay: with offload: the one-step-delayed update (the host step runs
            through the next forward and backward; gradients one update stale).
        expert_params: expert parallelism: the expert weights (each ep rank holds other
            experts), which ``expert_group`` replicates.
        expert_group: the expert replica group (:meth:`~plait.mesh.Mesh.expert_axes`):
            the ranks of the axis holding the same experts. The expert weights of every
            unit form a unit of their own (``<unit>:experts``), sharded over this group
            at stages 1-3 (replicated over it at stage 0; hybrid sharding does not apply
            to them); their gradients are reduced over it only, scaled to the average
            over the axis' ranks (the global batch's mean loss).
        driver: who sequences the gathers and reductions (chosen once): "autograd"
            (hooks, :class:`~plait.parallel.zero.driver.AutogradDriver`) or "schedule"
            (stages 2/3 under pipeline parallelism: no hook is installed, the pipeline
            drives :attr:`drive`).
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
        axis: str | tuple[str, ...] = "dp",
        bucket_mb: float | None = None,
        init: Callable[[torch.Tensor], torch.Tensor] | None = None,
        offload_dir: str | None = None,
        offload_delay: bool = False,
        expert_params: Sequence[nn.Parameter] = (),
        expert_group: AxisGroup | None = None,
        driver: ZeroDriver = "autograd",
    ) -> None:
        super().__init__()
        check_positive("", bucket_mb=bucket_mb)
        check_choice("ZeRO driver", driver, ZERO_DRIVERS)
        if driver == "schedule" and stage not in SCHEDULE_STAGES:
            raise ConfigError(f"the pipeline schedule drives ZeRO stages 2 and 3, not {stage}")
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        check_choice("ZeRO stage", stage, ZERO_STAGES, ZERO_MEANING)
        dp = math.prod(mesh.size(a) for a in axes)
        check_shard_size(zero_shard_size, stage, dp)
        factor = 1 if stage == 0 else (zero_shard_size or dp)
        check_choice("offload", offload, OFFLOADS)
        check_offload(offload, stage)
        trainable = [p for p in module.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("ZeroDataParallel needs a module with a trainable parameter")
        self.module = module
        self.mesh = mesh
        self.stage = stage
        self.offload: Offload = offload
        self.offload_dir = offload_dir  # the NVMe tier (offload_store); None: host memory
        self.offload_delay = offload_delay  # one-step-delayed host update (offload.py)
        if offload_dir is not None and offload == "none":
            raise ConfigError("offload_dir needs offload = 'optimizer' or 'params'")
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.find_unused_parameters = find_unused_parameters
        self.record_events = record_events
        self.events: list[tuple[str, str]] = []
        meta = any(p.is_meta for p in trainable)
        if meta and init is None:
            raise ValueError("ZeroDataParallel: meta parameters need init (their values)")
        self.device = mesh.device if meta else trainable[0].device
        self.param_dtype = parse_dtype(param_dtype) if param_dtype else trainable[0].dtype
        self.reduce_dtype = parse_dtype(reduce_dtype) if reduce_dtype else self.param_dtype
        self.dp_group = mesh.axis(*axes)
        self.shard_group, self.replicate_group = mesh.split_axis(axes, factor)
        self._experts = {id(p) for p in expert_params}
        if not meta:  # (each ep rank holds its own experts)
            broadcast_module_state(module, self.dp_group, self._experts)
        specs = plan_units(module, wrap)
        self.expert_groups: tuple[AxisGroup, AxisGroup] | None = None
        """Expert parallelism: (shard, replicate) groups of the expert units."""
        if self._experts:
            if expert_group is None:
                raise ValueError("ZeroDataParallel: expert_params need their expert_group")
            self.expert_groups = expert_unit_groups(expert_group, stage)
        self.units = make_units(
            specs, factor, self.shard_group.index, self._experts, self.expert_groups, self.dp_group
        )
        self.reducer = GradientReducer(
            self.units,
            stage,
            self.shard_group,
            self.replicate_group,
            self.reduce_dtype,
            self.device,
            find_unused_parameters,
            note=self._note_event,
            bucket_bytes=int(bucket_mb * 2**20) if bucket_mb is not None else None,
        )
        self.gatherer: ParameterGatherer | None = None  # stage 3 only
        if stage == 3:
            shard_device = torch.device("cpu") if offload == "params" else self.device
            self.gatherer = ParameterGatherer(
                self.shard_group, self.device, shard_device, note=self._note_event
            )
        # stages 1/2: the all-gathers launched by sync_params, completed before each
        # unit's next forward (or any full read); kept under every driver
        self._param_sync = ParamSync(
            self.shard_group, self.param_dtype, self.device, self._note_event
        )
        self._sync_hooks: list[Any] = []
        sharded = [u for u in self.units if self._groups(u)[0].size > 1]
        if stage in (1, 2) and sharded:
            for u in self.units:
                for m in u.triggers or [module]:
                    hook = functools.partial(self._before_forward, u)
                    self._sync_hooks.append(m.register_forward_pre_hook(hook))
            self._sync_hooks.append(self.register_state_dict_pre_hook(self._before_state_dict))
            for m in module.modules():  # a state_dict of any part reads full parameters
                self._sync_hooks.append(m.register_state_dict_pre_hook(self._before_state_dict))
        if meta and init is not None and self._experts:
            init = local_experts_as_they_are(init)
        for u in self.units:
            self._init_unit(u, init if meta else None)
        self.driven_by: ZeroDriver = driver
        self.drive = ZeroDrive(stage, self.units, self.reducer, self.gatherer, self.wait_params)
        """What the one driver sequences (the pipeline engine is handed it)."""
        self.driver: AutogradDriver | None = None  # the schedule's lives in the pipeline
        if driver == "autograd":
            self.driver = AutogradDriver(
                module, self.drive, reshard_after_forward, prefetch, note=self._note_event
            )

    # ------------------------------------------------------------------ set-up

    @torch.no_grad()
    def _init_unit(self, u: FlatUnit, init: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        # (padded,) the exact initial values (fp64 parameters stay fp64), zero padding;
        # from init (meta parameters): stage 3 builds only this rank's (shard,) range
        wide = torch.float64 if any(p.dtype == torch.float64 for p in u.params) else torch.float32
        only_shard = init is not None and self.gatherer is not None
        if init is None:
            flat = u.flatten(wide)
        else:
            lo, hi = (u.lo, u.hi) if only_shard else (0, u.padded)
            flat = u.initial_values(init, lo, hi, wide, self.device)
            for p in u.params:  # storage of their own: a view is set below or at gather
                empty = torch.empty((0,) * p.dim(), dtype=self.param_dtype, device=self.device)
                give_storage(p, empty)
        shard = flat if only_shard else flat[u.lo : u.hi]  # (shard,)
        if self.param_dtype in (torch.bfloat16, torch.float16):
            u.fp32_init = shard.float()  # (shard,) initial fp32 masters
        if only_shard:
            assert self.gatherer is not None
            u.full = unallocated(u.padded, self.param_dtype, self.device)
            self.gatherer.adopt(u, shard.to(self.param_dtype))
        else:
            u.full = flat.to(self.param_dtype) if self.param_dtype != wide else flat
            if self.gatherer is not None:  # keeps the shard, frees the rest
                self.gatherer.adopt(u)
            else:
                for i, p in enumerate(u.params):
                    p.data = u.view(i, u.full)
        self._init_grads(u)

    def _init_grads(self, u: FlatUnit) -> None:
        if self.stage <= 1:
            u.grad_full = torch.zeros(u.padded, dtype=self.param_dtype, device=self.device)
            for i, p in enumerate(u.params):
                p.grad = u.view(i, u.grad_full)
        else:
            u.grad_shard = torch.zeros(u.shard_numel, dtype=self.reduce_dtype, device=self.device)

    def _groups(self, u: FlatUnit) -> tuple[AxisGroup, AxisGroup]:
        """(shard, replicate) groups of ``u``: its own (expert units) or the wrapper's."""
        return u.groups if u.groups is not None else (self.shard_group, self.replicate_group)

    # ------------------------------------------------------------------ callbacks

    def _note_event(self, kind: str, name: str) -> None:
        if self.record_events:
            self.events.append((kind, name))

    def _before_forward(self, u: FlatUnit, module: nn.Module, args: Any) -> None:
        """Stages 1/2: ``u``'s updated parameters must be in place before it computes."""
        if self._param_sync.in_flight:
            self.wait_params(u)

    def _before_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.wait_params()

    # ------------------------------------------------------------------ counters

    @property
    def gathered_bytes(self) -> int:
        """Stage 3: bytes of full parameters gathered (or gathering) now."""
        return self.gatherer.gathered_bytes if self.gatherer is not None else 0

    @property
    def peak_gathered_bytes(self) -> int:
        """Stage 3: the most gathered parameter bytes at once."""
        return self.gatherer.peak_gathered_bytes if self.gatherer is not None else 0

    @property
    def peak_gathered_units(self) -> int:
        """Stage 3: the most units gathered (or gathering) at once."""
        return self.gatherer.peak_gathered_units if self.gatherer is not None else 0

    @property
    def grad_buffer_bytes(self) -> int:
        """Stages 2/3: bytes of the transient full-gradient buffers alive now."""
        return self.reducer.grad_buffer_bytes

    @property
    def peak_grad_buffer_bytes(self) -> int:
        """Stages 2/3: the most transient gradient-buffer bytes alive at once."""
        return self.reducer.peak_grad_buffer_bytes

    def reset_peak_gathered(self) -> None:
        """Restart the peak counters (gathered bytes/units, gradient buffers)."""
        self.reducer.reset_peak()
        if self.gatherer is not None:
            self.gatherer.reset_peaks()

    # ------------------------------------------------------------------ API

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (stage 3 gathers units on demand)."""
        if self.record_events and not self.reducer.in_backward:
            self.events = []
        if self.driver is not None:
            self.driver.begin_forward()
        out = self.module(*args, **kwargs)
        if self.driver is not None:
            self.driver.end_forward(out)
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
        """Hold every unit's full parameters inside the block (e.g. to read the weights):
        stage 3 gathers them; stages 1/2 complete the all-gathers still in flight from
        the last step; stage 0 holds them always."""
        self.wait_params()
        if self.gatherer is not None:
            self.gatherer.gather_all()
        try:
            yield
        finally:
            if self.gatherer is not None:
                self.gatherer.free_all()

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
    def sync_params(self, wait: bool = False) -> None:
        """Stages 1/2 after an optimizer step: all-gather the updated shards so every
        rank holds the full parameters again (stage 3 gathers at the next forward).

        The all-gathers (one per unit or bucket, in forward order) are launched and left
        in flight: each unit's is completed by a forward pre-hook just before the unit
        computes, so communication overlaps the forward of the units before it.
        ``wait=True`` (or :meth:`wait_params`) completes them now."""
        if self.stage == 3 or all(self._groups(u)[0].size == 1 for u in self.units):
            return
        self.wait_params()  # a previous step's gathers (a step with no forward between)
        self._param_sync.launch(self.reducer.buckets)
        if wait:
            self.wait_params()

    def wait_params(self, unit: FlatUnit | None = None) -> None:
        """Stages 1/2: complete the all-gather of ``unit``'s updated shards (every
        unit's when None; a bucket's units complete together) launched by
        :meth:`sync_params`; a no-op when none is in flight."""
        self._param_sync.wait(unit)

    @property
    def gathers_in_flight(self) -> int:
        """Stages 1/2: units whose post-step all-gather is launched and not completed."""
        return self._param_sync.in_flight

    def local_pieces(self) -> list[LocalPiece]:
        """This rank's runs of each parameter in its shards, named as in ``module``: a
        unit's shard ``[lo, hi)`` of the flat, padded parameters covers runs of one or more
        parameters (padding left out). Replicas of a shard (hybrid sharding) are equal
        after the step, so only the first replicate rank writes."""
        self.wait_params()
        names = {id(p): n for n, p in self.module.named_parameters()}
        out: list[LocalPiece] = []
        for u in self.units:
            first = self._groups(u)[1].index == 0
            shard = self.param_shard(u)  # (shard_numel,) model dtype
            for i, a, b in u.local_segments():
                p, at = u.params[i], u.lo + a - u.offsets[i]  # at: first element in p
                name, shape, run = names[id(p)], list(u.shapes[i]), shard[a:b]
                out.append(
                    LocalPiece(name, shape, None, at, at + b - a, run, p, self.param_dtype, first)
                )
        return out

    def unit_summary(self) -> list[tuple[str, int, int, int]]:
        """``(name, parameters, numel, padded numel)`` of every unit."""
        return [(u.name, len(u.params), u.numel, u.padded) for u in self.units]

    # ------------------------------------------------------------------ optimizer
    # What plait.optim.Optimizer reads (its OptimizerTarget protocol).

    def norm_groups(self) -> list[AxisGroup]:
        """The groups a global gradient norm's local square is summed over: the shard
        group (each element of a replica on exactly one rank) and the mesh's tp axis,
        each when it has several ranks. Replicas of a shard hold equal gradients. With
        expert units: the whole axis (each rank's experts are others; every piece is
        weighted by 1/its replicas, :meth:`norm_weight`)."""
        if self.expert_groups is not None:
            groups = [self.dp_group] if self.dp_group.size > 1 else []
        else:
            groups = [self.shard_group] if self.shard_group.size > 1 else []
        if self.mesh.size("tp") > 1:
            groups.append(self.mesh.axis("tp"))
        return groups

    def norm_weight(self, p: torch.Tensor) -> float:
        """Weight of ``p``'s squared gradient norm in the global norm: 1/k for a tensor
        held identically by k tp ranks, else 1; with expert units also 1/r for a shard
        held identically by the r ranks of its replicate group (the norm is summed over
        the whole axis)."""
        if self.expert_groups is None:
            return tp_norm_weight(p)
        rep = self.expert_groups[1] if id(p) in self._experts else self.replicate_group
        return tp_norm_weight(p) / rep.size

    def zero_wrapper(self) -> ZeroDataParallel:
        """This wrapper: the optimizer steps fp32 masters of its shards
        (:class:`~plait.parallel.zero.optim.ShardedMasters`)."""
        return self
