"""Flat parameters for ZeRO: wrap units, flattening, padding and even sharding.

A *wrap unit* is a group of parameters gathered, reduced and freed together (the FSDP
"unit" of Zhao et al. 2023). By default each transformer block is a unit, and so are the
embeddings and the output head; any parameter not inside a unit belongs to the *root*
unit, and so does a parameter shared by two units (e.g. tied embeddings). Units are chosen
by a policy: ``None`` (the default above), a sequence of module classes, or a function
``(qualified name, module) -> bool``. When selected modules nest, a parameter belongs to
the innermost one.

Within a unit the parameters are flattened and concatenated in registration order, then
padded with zeros to a multiple of the shard count F and cut into F equal chunks: rank
``i`` of the shard group owns elements ``[i·S, (i+1)·S)`` with ``S = padded / F``
(Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models"). The original ``nn.Parameter`` objects stay in the model; their ``.data``
becomes a view into the unit's flat buffer, so model code is untouched.

Under expert parallelism the expert weights of a unit form a unit of their own
(:func:`split_expert_units`, named ``<unit>:experts``, triggered by the same modules):
its shards, reductions and gathers run over its own groups (:attr:`FlatUnit.groups`, the
expert replica group), not the wrapper's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from plait.comm import AxisGroup

WrapPolicy = Callable[[str, nn.Module], bool]
WrapSpec = WrapPolicy | Sequence[type[nn.Module]] | type[nn.Module] | None
"""How units are chosen: None (default), module classes, or a policy function."""

ROOT = "<root>"
"""Name of the root unit (parameters outside every wrapped module, and shared ones)."""


def default_block_classes(model: nn.Module | None = None) -> tuple[type[nn.Module], ...]:
    """Module classes treated as transformer blocks: plait's ``Block``, torch's
    ``TransformerEncoderLayer`` / ``TransformerDecoderLayer`` and, given ``model``, the
    classes a Hugging Face model names in ``_no_split_modules`` (its decoder layers,
    e.g. ``LlamaDecoderLayer``)."""
    from plait.model.transformer import Block

    classes: list[type[nn.Module]] = [Block, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer]
    declared = set(getattr(model, "_no_split_modules", None) or ()) if model is not None else set()
    if declared:
        for m in model.modules():  # type: ignore[union-attr]
            if type(m).__name__ in declared and type(m) not in classes:
                classes.append(type(m))
    return tuple(classes)


def default_unit_names(model: nn.Module) -> list[str]:
    """The default units: every transformer block and embedding, plus each top-level
    child that holds parameters outside those (the output head, typically; the
    elements of a top-level ``ModuleList`` / ``ModuleDict`` count as top-level).

    For plait's ``Transformer``: ``tok_embeddings``, each ``layers.i`` and ``output``;
    the final norm stays in the root unit.
    """
    from plait.model.transformer import Transformer

    if isinstance(model, Transformer):
        return ["tok_embeddings", *(f"layers.{i}" for i in range(len(model.layers))), "output"]
    classes = (*default_block_classes(model), nn.Embedding)
    names = [n for n, m in model.named_modules() if n and isinstance(m, classes)]
    covered = set(names)
    for child_name, child in _called_children(model, ""):
        if child_name in covered or not any(p.requires_grad for p in child.parameters()):
            continue
        uncovered = False
        for pname, p in child.named_parameters(prefix=child_name):
            if p.requires_grad and _owner(pname, covered) is None:
                uncovered = True
                break
        if uncovered:
            names.append(child_name)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(names, key=lambda n: order[n])


def _called_children(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    """The children of ``module`` whose forward runs: a ``ModuleList`` / ``ModuleDict``
    is never called itself (a unit there would never be gathered), so its own children
    stand in for it."""
    for name, child in module.named_children():
        full = f"{prefix}.{name}" if prefix else name
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            yield from _called_children(child, full)
        else:
            yield full, child


def select_units(model: nn.Module, wrap: WrapSpec) -> list[str]:
    """Qualified names of the modules that become units, in module order."""
    if wrap is None:
        return default_unit_names(model)
    if isinstance(wrap, type):
        wrap = (wrap,)
    if isinstance(wrap, (list, tuple, set, frozenset)):
        classes = tuple(wrap)
        return [n for n, m in model.named_modules() if n and isinstance(m, classes)]
    if not callable(wrap):
        raise TypeError(f"wrap must be None, module classes or a function, got {wrap!r}")
    policy = wrap
    return [n for n, m in model.named_modules() if n and policy(n, m)]


def _owner(param_name: str, selected: set[str]) -> str | None:
    """The innermost selected module that contains the parameter ``param_name``."""
    parts = param_name.split(".")[:-1]
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        if prefix in selected:
            return prefix
    return None


@dataclass
class UnitSpec:
    """Which parameters a unit holds and which modules' forwards need it."""

    name: str
    module: nn.Module | None  # the wrapped module; None for the root unit
    params: list[nn.Parameter] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    triggers: list[nn.Module] = field(default_factory=list)  # root: direct owners


def plan_units(model: nn.Module, wrap: WrapSpec) -> list[UnitSpec]:
    """Assign every trainable parameter to one unit (the root unit last).

    A parameter reachable under two different units (weight tying) goes to the root unit,
    whose triggers are the modules that directly own its parameters.
    """
    selected = select_units(model, wrap)
    sel = set(selected)
    modules = dict(model.named_modules())
    owner_of: dict[nn.Parameter, str] = {}
    first_name: dict[nn.Parameter, str] = {}
    direct_owners: dict[nn.Parameter, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        owner = _owner(pname, sel) or ROOT
        if p in owner_of and owner_of[p] != owner:
            owner_of[p] = ROOT
        else:
            owner_of.setdefault(p, owner)
        first_name.setdefault(p, pname)
        direct_owners.setdefault(p, []).append(pname.rpartition(".")[0])
    specs = {n: UnitSpec(n, modules[n], triggers=[modules[n]]) for n in selected}
    root = UnitSpec(ROOT, None)
    for p, owner in owner_of.items():
        spec = specs[owner] if owner != ROOT else root
        spec.params.append(p)
        spec.names.append(first_name[p])
        if owner == ROOT:
            for mod_name in direct_owners[p]:
                m = modules[mod_name]
                if all(m is not t for t in root.triggers):
                    root.triggers.append(m)
    out = [s for s in specs.values() if s.params]
    if root.params:
        out.append(root)
    return out


EXPERTS = ":experts"
"""Suffix of the name of a unit holding the expert weights of another (``layers.1:experts``)."""


def split_expert_units(specs: list[UnitSpec], experts: set[int]) -> list[UnitSpec]:
    """``specs`` with the parameters whose id is in ``experts`` moved to a unit of their
    own right after their unit (same triggers); the order is otherwise kept."""
    out: list[UnitSpec] = []
    for s in specs:
        keep = [(p, n) for p, n in zip(s.params, s.names, strict=True) if id(p) not in experts]
        moved = [(p, n) for p, n in zip(s.params, s.names, strict=True) if id(p) in experts]
        if keep:
            out.append(
                UnitSpec(s.name, s.module, [p for p, _ in keep], [n for _, n in keep], s.triggers)
            )
        if moved:
            out.append(
                UnitSpec(
                    s.name + EXPERTS,
                    s.module,
                    [p for p, _ in moved],
                    [n for _, n in moved],
                    s.triggers,
                )
            )
    return out


class FlatUnit:
    """The flat, padded, evenly sharded layout of one unit's parameters.

    Holds the arithmetic and the tensors; :class:`plait.parallel.zero.ZeroDataParallel`
    drives gathering, freeing and reduction.
    """

    def __init__(
        self,
        index: int,
        spec: UnitSpec,
        shard_count: int,
        shard_index: int,
    ) -> None:
        self.index = index
        self.name = spec.name
        self.module = spec.module
        self.triggers = spec.triggers
        self.params = spec.params
        self.names = spec.names
        self.shapes = [p.shape for p in spec.params]
        self.numels = [p.numel() for p in spec.params]
        self.offsets: list[int] = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.numel = total
        self.shard_count = shard_count
        self.padded = math.ceil(total / shard_count) * shard_count
        self.shard_numel = self.padded // shard_count
        self.lo = shard_index * self.shard_numel  # this rank's range [lo, hi) of the flat unit
        self.hi = self.lo + self.shard_numel
        # tensors, filled by the wrapper
        self.full: torch.Tensor = torch.empty(0)  # (padded,) parameter dtype
        self.shard: torch.Tensor | None = None  # ZeRO-3: (shard_numel,) persistent
        self.grad_full: torch.Tensor | None = None  # (padded,) full-size gradient buffer
        self.grad_shard: torch.Tensor | None = None  # (shard_numel,) reduced gradient shard
        self.fp32_init: torch.Tensor | None = None  # (shard_numel,) fp32 initial master
        self.groups: tuple[AxisGroup, AxisGroup] | None = None
        """(shard group, replicate group) of a unit sharded over other ranks than the
        wrapper's (expert weights: their replica group); None: the wrapper's groups."""
        self.grad_scale = 1.0
        """Factor on the averaged gradient shard (expert units: replica ranks / data
        ranks, as the gradient of the global mean loss is their sum over the data ranks)."""

    def flatten(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(padded,)`` concatenation of the parameters' current values in ``dtype``."""
        device = self.params[0].device
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for p, off, n in zip(self.params, self.offsets, self.numels, strict=True):
            flat[off : off + n].copy_(p.detach().reshape(-1))
        return flat

    def view(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        """Parameter ``i`` as a view into the flat ``(padded,)`` tensor ``flat``."""
        off, n = self.offsets[i], self.numels[i]
        return flat[off : off + n].view(self.shapes[i])

    def local_segments(self) -> list[tuple[int, int, int]]:
        """``(param index, start, end)`` of every parameter piece in this rank's shard,
        in shard coordinates (``0 <= start < end <= shard_numel``); padding is left out."""
        return self.segments(self.lo, self.hi)

    def segments(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """``(param index, start, end)`` of every parameter piece in the range
        ``[lo, hi)`` of the flat unit, relative to ``lo``; padding is left out."""
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                out.append((i, a - lo, b - lo))
        return out

    def initial_values(
        self,
        init: Callable[[torch.Tensor], torch.Tensor],
        lo: int,
        hi: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """``(hi - lo,)`` the range ``[lo, hi)`` of the flat unit of a meta-built model in
        ``dtype`` on ``device`` (zero padding): each parameter's value comes from ``init``
        (its full local value on the CPU, one parameter at a time) cast to the
        parameter's dtype."""
        flat = torch.zeros(hi - lo, dtype=dtype, device=device)
        for i, a, b in self.segments(lo, hi):
            p = self.params[i]
            value = init(p).to(p.dtype).reshape(-1)  # (numel,) one parameter, transient
            at = lo + a - self.offsets[i]
            flat[a:b].copy_(value[at : at + b - a])
        return flat

    @property
    def local_valid_numel(self) -> int:
        """Elements of this rank's shard that belong to parameters (not padding)."""
        return sum(e - s for _, s, e in self.local_segments())

    def __repr__(self) -> str:
        return (
            f"FlatUnit({self.name!r}, params={len(self.params)}, numel={self.numel}, "
            f"padded={self.padded}, shard={self.shard_numel})"
        )
