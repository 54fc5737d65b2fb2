"""Freeze a model and give its targeted linear layers LoRA adapters (``parallelize``'s
step 1c, after tensor parallelism, before context parallelism and the pipeline split).

:func:`apply_lora` works on a model on a real device or on the meta device, one device
or already tensor-parallel: each adapter's factors get this rank's piece of their
one-device value (see :mod:`plait.parallel.lora.branch` for how they split), drawn from
the run seed and the factor's one-device name (``A``: PEFT's Kaiming-uniform,
``bound = 1/sqrt(in)``; ``B``: zeros), or read from a PEFT adapter
(``lora.init_from``). On the meta device the factors stay meta and their values are
served by :class:`LoraValues` when ``parallelize`` materialises the rank's pieces, so
every layout starts from the same adapters without any broadcast.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from plait.config import LoraConfig
from plait.config.rules.lora import LORA_TARGETS
from plait.errors import ConfigError
from plait.model.init import param_seed
from plait.parallel.lora.branch import ADAPTABLE, LoraBranch, attach, local_features, weight_of
from plait.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPShard,
    set_shard_info,
    shard_info,
)
from plait.parallel.tensor.sequence import grad_sum_groups, sum_grad_over_tp


@dataclass
class LoraApplied:
    """What :func:`apply_lora` did: the adapted layers' one-device names, the adapter
    parameters, and the one-device value of each factor by one-device name."""

    layers: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)
    values: dict[str, torch.Tensor] = field(default_factory=dict)


def lora_layers(model: nn.Module, targets: tuple[str, ...]) -> dict[str, list[str]]:
    """Each target short name -> the names of the adaptable layers it matches (last
    name component in :data:`~plait.config.rules.lora.LORA_TARGETS`); a target that
    matches no layer raises :class:`ConfigError`."""
    found: dict[str, list[str]] = {t: [] for t in targets}
    for name, m in model.named_modules():
        last = name.rpartition(".")[2]
        for t in targets:
            if last in LORA_TARGETS[t] and isinstance(m, ADAPTABLE):
                found[t].append(name)
    for t, names in found.items():
        if not names:
            raise ConfigError(
                f"lora.targets: {t!r} matches no linear layer of {type(model).__name__} "
                f"(looked for layers named {' or '.join(LORA_TARGETS[t])})."
            )
    return found


def adapter_parameters(model: nn.Module, cfg: LoraConfig) -> int:
    """The parameters the adapters of ``cfg`` add to the one-device ``model`` (before
    ``parallelize``; 0 when LoRA is off): ``rank · (in + out)`` per adapted layer."""
    if cfg.rank is None:
        return 0
    modules = dict(model.named_modules())
    found = lora_layers(model, cfg.target_names)
    return sum(
        cfg.rank * _full_shape(modules[n], "lora_A", 1)[1]
        + cfg.rank * _full_shape(modules[n], "lora_B", 1)[0]
        for names in found.values()
        for n in names
    )


def initial_factor(seed: int, name: str, shape: tuple[int, int]) -> torch.Tensor:
    """The one-device initial value of factor ``name`` (float32, CPU): ``lora_A``
    ``(rank, in)`` as PEFT draws it (``kaiming_uniform_(a=sqrt(5))``: uniform in
    ``±1/sqrt(in)``) from a generator seeded by (seed, name); ``lora_B`` zeros."""
    if name.endswith("lora_B.weight"):
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(param_seed(seed, name))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=g)


def apply_lora(
    model: nn.Module,
    cfg: LoraConfig,
    *,
    seed: int,
    base_dtype: torch.dtype | None = None,
    initial: Mapping[str, torch.Tensor] | None = None,
) -> LoraApplied:
    """Freeze every parameter of ``model``, cast the frozen ones to ``base_dtype`` (if
    given; the adapters keep the model's dtype, for the optimizer's masters) and attach
    adapters of rank ``cfg.rank`` to the layers ``cfg.targets`` name. ``initial`` (full
    one-device values by one-device name, e.g. a PEFT adapter's) replaces the drawn
    initial values; it must hold every factor. Names are ``model``'s module names, the
    one-device ones (tensor parallelism keeps them)."""
    if cfg.rank is None:
        raise ValueError("apply_lora needs lora.rank")
    layers = [n for names in lora_layers(model, cfg.target_names).values() for n in names]
    modules = dict(model.named_modules())
    dtypes = {id(p): p.dtype for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
        if base_dtype is not None and p.dtype != base_dtype:
            p.data = p.data.to(base_dtype)
    out = LoraApplied()
    for name in sorted(layers, key=list(modules).index):
        layer = modules[name]
        w = weight_of(layer)  # (out_local, in_local)
        a, b = _factors(layer, cfg.rank, dtypes[id(w)], w.device)
        for factor, p in (("lora_A", a), ("lora_B", b)):
            key = f"{name}.{factor}.weight"
            full_shape = _full_shape(layer, factor, cfg.rank)
            full = initial[key] if initial is not None and key in initial else None
            if initial is not None and full is None:
                raise ConfigError(f"lora.init_from: the adapter has no tensor for {key}")
            if full is None:
                full = initial_factor(seed, key, full_shape)
            if tuple(full.shape) != full_shape:
                raise ConfigError(
                    f"lora.init_from: {key} has shape {list(full.shape)} in the adapter but "
                    f"{list(full_shape)} here (rank {cfg.rank})"
                )
            out.values[key] = full
            if not p.is_meta:
                info = shard_info(p)
                index = layer.group.index if info is not None else 0
                piece = info.shard(full, index) if info is not None else full
                with torch.no_grad():
                    p.copy_(piece.to(p.dtype))
        attach(layer, a, b, LoraBranch(layer, cfg.scale, cfg.dropout))
        out.layers.append(name)
        out.params += [a, b]
    return out


def _full_shape(layer: nn.Module, factor: str, rank: int) -> tuple[int, int]:
    """The one-device shape of ``layer``'s ``factor``: A ``(rank, in)``, B ``(out, rank)``."""
    fin, fout = layer.in_features, layer.out_features  # one-device features
    assert isinstance(fin, int) and isinstance(fout, int)
    return (rank, fin) if factor == "lora_A" else (fout, rank)


def _factors(
    layer: nn.Module, rank: int, dtype: torch.dtype, device: torch.device
) -> tuple[nn.Parameter, nn.Parameter]:
    """This rank's ``A`` ``(rank, in_local)`` and ``B`` ``(out_local, rank)`` of
    ``layer``, unset (on ``device``), with their tensor-parallel layout and gradient
    sums: column-parallel -> B split like W (and summed over W's replica groups), A
    replicated and summed over tp; row-parallel -> A split like W, B replicated and
    summed over tp."""
    fin, fout = local_features(layer)
    a = nn.Parameter(torch.empty(rank, fin, dtype=dtype, device=device))
    b = nn.Parameter(torch.empty(fout, rank, dtype=dtype, device=device))
    if isinstance(layer, ColumnParallelLinear):
        set_shard_info(a, TPShard.replicated(layer.group.size))
        sum_grad_over_tp(a, layer.group)
        set_shard_info(b, layer.info)
        for group in grad_sum_groups(weight_of(layer)):  # (key/value replicas)
            sum_grad_over_tp(b, group)
    elif isinstance(layer, RowParallelLinear):
        set_shard_info(a, layer.info)
        set_shard_info(b, TPShard.replicated(layer.group.size))
        sum_grad_over_tp(b, layer.group)
    return a, b


class LoraValues:
    """One-device initial values for :class:`~plait.parallel.materialize.LocalInit`:
    the adapters' (``lora``) first, then the model's own (``base``, anything with
    ``value(name)``)."""

    def __init__(self, base: object, lora: Mapping[str, torch.Tensor]) -> None:
        self.base = base
        self.lora = lora

    def value(self, name: str) -> torch.Tensor:
        """The full one-device value of ``name`` (CPU)."""
        if name in self.lora:
            return self.lora[name]
        out: torch.Tensor = self.base.value(name)  # type: ignore[attr-defined]
        return out
