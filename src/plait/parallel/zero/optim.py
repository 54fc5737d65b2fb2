"""The optimizer side of ZeRO: the fp32 master shards an element-wise optimizer steps.

:class:`ShardedMasters` takes any element-wise ``torch.optim`` optimizer (AdamW, Adam,
SGD with momentum, ...) built over a :class:`~plait.parallel.zero.ZeroDataParallel`
model's parameters and rebuilds it over this rank's *shards*: for every unit, the fp32
master copy of the rank's ``1/F`` slice of the flat parameters, cut at parameter
boundaries into segments so each segment keeps the hyper-parameters (learning rate,
weight decay) of the param group its parameter was in. Optimizer state is therefore
allocated for the shard only (ZeRO-1, Rajbhandari et al. 2020). With fp32 parameters
and no offload the masters *are* the parameter shards (no copy); with bf16/fp16
parameters they are separate fp32 tensors initialised from the exact fp32 weights; with
offload they live on the CPU, the gradient shards are copied there, the step runs there
and the result is copied back.

Two optimizers that need whole matrices are rebuilt differently: Muon (one owner rank
per matrix, :mod:`plait.parallel.zero.owners`) and Adafactor (its row and column sums
all-reduced over the shard group, :class:`plait.optimizers.adafactor.ShardedAdafactor`
over the pieces :mod:`plait.parallel.adafactor` describes).

Clipping, loss scaling and skipping are not here: :class:`plait.optim.Optimizer` does
them for every layout and calls :meth:`ShardedMasters.grads` and
:meth:`ShardedMasters.step`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.optimizers.adafactor import ShardedAdafactor
from plait.optimizers.factored import Held
from plait.optimizers.muon import Muon
from plait.parallel.adafactor import held_in_unit
from plait.parallel.precision import is_low_precision
from plait.parallel.zero.cpu_adam import host_optimizer
from plait.parallel.zero.flat import FlatUnit
from plait.parallel.zero.owners import MatrixOwners
from plait.parallel.zero.wrapper import ZeroDataParallel
from plait.pieces import LocalPiece

if TYPE_CHECKING:
    from plait.parallel.zero.offload import HostStep

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


@dataclass
class Slot:
    """One unit's shard as the inner optimizer sees it."""

    unit: FlatUnit
    master: torch.Tensor  # (shard_numel,) fp32 (or the fp32/fp64 parameter shard itself)
    alias: bool  # master is the model's parameter shard (no copy back needed)
    segments: list[tuple[nn.Parameter, int, int]]  # optimizer params = master[start:end]
    pieces: list[tuple[nn.Parameter, int, int]]  # (model parameter, start, end) of each piece


def rebuild(
    optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """A fresh optimizer of ``optimizer``'s class and defaults over ``groups``."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return cls(groups, **kwargs)


def adafactor_over(
    optimizer: torch.optim.Optimizer,
    groups: list[dict[str, Any]],
    held: list[Held],
    master: torch.Tensor,
) -> ShardedAdafactor:
    """Adafactor (torch's or plait's, with its defaults) over the master segments:
    statistics all-reduced over the shard groups (and tp), see
    :mod:`plait.optimizers.adafactor`."""
    if optimizer.defaults.get("maximize", False):
        raise ValueError("Adafactor with maximize=True is not supported under ZeRO")
    keys = ("lr", "beta2_decay", "eps", "d", "weight_decay")
    kwargs = {k: optimizer.defaults[k] for k in keys}
    return ShardedAdafactor(groups, held, dtype=master.dtype, device=master.device, **kwargs)


class ShardedMasters:
    """The sharded masters of ``zero`` and the inner optimizer over them.

    Args:
        zero: the ZeRO-wrapped model.
        optimizer: a ``torch.optim`` optimizer built over the model's parameters (its
            param groups and defaults are copied), or a factory ``groups -> optimizer``
            called with the segment groups.
    """

    def __init__(
        self, zero: ZeroDataParallel, optimizer: torch.optim.Optimizer | OptimizerFactory
    ) -> None:
        self.zero = zero
        self.slots: list[Slot] = []
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
        factored = isinstance(optimizer, (torch.optim.Adafactor, ShardedAdafactor))
        factors: list[Held] = []  # Adafactor: every stepped parameter's piece on this rank
        stepped = {id(p) for p in group_of}
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
            pieces = [(u.params[i], a, b) for i, a, b in u.local_segments()]
            by_index: dict[int, torch.Tensor] = {}
            for i, start, end in u.local_segments():
                group = group_of.get(u.params[i])
                if group is None:
                    continue
                seg = nn.Parameter(master[start:end])  # shares the master's storage
                groups[group]["params"].append(seg)
                segments.append((seg, start, end))
                by_index[i] = seg
            self.slots.append(Slot(u, master, alias, segments, pieces))
            if factored:
                over = u.groups[0] if u.groups is not None else zero.shard_group
                factors += held_in_unit(u, by_index, stepped, over, zero.mesh)
        muon = isinstance(optimizer, Muon)
        if muon:
            if offload:
                raise TypeError("Muon under ZeRO-Offload is not supported (offload = 'none')")
            for g in groups:  # their params are flat shard pieces, not matrices
                g["sharded"] = g["muon"]
        build = host_optimizer if offload else rebuild  # the host: fused CPU AdamW
        self.inner: torch.optim.Optimizer
        if factored:
            assert isinstance(optimizer, torch.optim.Optimizer)
            if offload:
                raise TypeError("Adafactor under ZeRO-Offload is not supported (offload = 'none')")
            self.inner = adafactor_over(optimizer, groups, factors, self.slots[0].master)
        else:
            self.inner = (
                build(optimizer, groups)
                if isinstance(optimizer, torch.optim.Optimizer)
                else optimizer(groups)
            )
        # (model parameter, first element within it) -> (slot, segment, shard start, end)
        self._segment_at: dict[tuple[int, int], tuple[Slot, nn.Parameter, int, int]] = {}
        for slot in self.slots:
            u = slot.unit
            seg_of = {(a, b): seg for seg, a, b in slot.segments}
            for i, a, b in u.local_segments():
                held = seg_of.get((a, b))
                if held is not None:
                    at = u.lo + a - u.offsets[i]
                    self._segment_at[(id(u.params[i]), at)] = (slot, held, a, b)
        self.host: HostStep | None = None  # ZeRO-Offload's host side
        self.owners: MatrixOwners | None = None  # Muon: one owner rank per matrix
        if muon:
            assert isinstance(self.inner, Muon) and isinstance(optimizer, Muon)
            self.owners = MatrixOwners(
                self,
                {gi for gi, g in enumerate(base) if g["muon"]},
                group_of,
                {gi: bool(g["in_out"]) for gi, g in enumerate(base)},
                int(optimizer.defaults["ns_steps"]),
            )
            self.inner.matrix_step = self.owners
            self.inner.tp = optimizer.tp
        if offload:
            from plait.parallel.zero.offload import HostStep

            self.host = HostStep(self, zero.offload_dir, zero.mesh.rank)

    def rebind(self, slot: Slot) -> None:
        """Point ``slot``'s optimizer segments at its (moved) ``master`` (before the
        first step: pinned or file-backed host memory)."""
        for seg, start, end in slot.segments:
            seg.data = slot.master[start:end]

    def grads(self) -> list[torch.Tensor]:
        """Master-dtype gradients on the master device, one ``(shard_numel,)`` per slot
        (offload: :meth:`HostStep.grads_for_step`, the device's reduced shards unless the
        update is delayed; scale them through ``host.scale``, see ``host.scales_on_host``)."""
        if self.host is not None:
            return self.host.grads_for_step()
        out = []
        for slot in self.slots:
            g = self.zero.reduced_grad(slot.unit)  # (shard_numel,) reduce dtype
            out.append(g.to(slot.master.device, slot.master.dtype))  # copy if they differ
        return out

    def norm_pieces(
        self, grads: list[torch.Tensor], weight: Callable[[torch.Tensor], float]
    ) -> tuple[list[torch.Tensor], list[float]]:
        """The gradient pieces of a global norm and their weights (``weight(param)``)."""
        pieces: list[torch.Tensor] = []
        weights: list[float] = []
        for slot, g in zip(self.slots, grads, strict=True):
            ws = [(a, b, weight(p)) for p, a, b in slot.pieces]
            if all(w == 1.0 for _, _, w in ws):
                pieces.append(g)  # the whole shard (its padding holds zeros)
                weights.append(1.0)
                continue
            for a, b, w in ws:
                pieces.append(g[a:b])
                weights.append(w)
        return pieces, weights

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        """The inner step on the masters, the copy back into the model dtype and the
        launch of the all-gathers of the updated shards (stages 1/2; each completes
        before its unit's next forward)."""
        self.zero.wait_params()  # the shards must not change under a gather in flight
        if self.host is not None:  # stepped on the host, slot by slot, copied back
            self.host.step()
            self.zero.sync_params()
            return
        for slot, g in zip(self.slots, grads, strict=True):
            for seg, start, end in slot.segments:
                seg.grad = g[start:end]
        self.inner.step()
        for slot in self.slots:
            for seg, _, _ in slot.segments:
                seg.grad = None
        copies = [s for s in self.slots if not s.alias]  # 16-bit params or offload
        if copies:  # one fused cast-and-copy of every master into the model dtype
            shards = [self.zero.param_shard(s.unit) for s in copies]
            torch._foreach_copy_(shards, [s.master for s in copies])
        self.zero.sync_params()

    def master_tensors(self) -> list[torch.Tensor]:
        """The separate fp32 master tensors (empty when the masters are the parameters)."""
        return [s.master for s in self.slots if not s.alias]

    def describe(self, piece: LocalPiece) -> LocalPiece | None:
        """The model's ``piece`` (a segment of one flattened parameter, ``piece.key``)
        with its master values and optimizer-state key; None when no optimizer group
        holds it."""
        hit = self._segment_at.get((id(piece.key), piece.start))
        if hit is None:
            return None
        slot, seg, a, b = hit
        return piece.but(value=slot.master[a:b], key=seg)
