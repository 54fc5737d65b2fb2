"""Build a model on the meta device and compute each parameter's initial value alone.

A model built under ``torch.device("meta")`` holds shapes and no storage. Its initial
weights are still defined: every parameter and buffer has a value that is a function of
the run seed and its one-device name only, computed one tensor at a time on the CPU by
:class:`InitialValues`. ``parallelize`` asks for the value of each tensor a rank keeps
and copies the rank's slice of it to the device
(:mod:`plait.parallel.materialize`), so no rank ever holds the whole model; the
transient is one full tensor (plus its tensor-parallel padding) at a time.

How a value is computed, first rule that applies:

1. the model defines ``initial_value(name, seed, shape) -> Tensor`` (plait's
   :class:`~plait.model.transformer.Transformer`: a generator per parameter, seeded by
   the run seed and the name; bit for bit what a direct build gives);
2. otherwise the *owner* module of the tensor (the module that registers it) is copied
   with CPU storage for its own tensors and initialised under torch's global generator
   seeded by :func:`param_seed` of the run seed and the owner's name: its
   ``reset_parameters()`` (every torch layer has one), then the model's Hugging Face
   style ``_init_weights(module)`` when it has one (``transformers`` models do).

A model whose owner modules have neither (a custom module with a bare
``nn.Parameter`` and no ``reset_parameters``) is not :func:`initialisable`:
:func:`plait.model.factory.build_meta_model` then builds it in full, with a warning.
A value still NaN after its owner's initialisers ran (an initialiser that skipped it)
raises :class:`~plait.errors.ConfigError` naming the tensor.
"""

from __future__ import annotations

import copy
import zlib
from typing import Any

import torch
from torch import nn

from plait.errors import ConfigError

SEED_ATTR = "plait_init_seed"
"""Attribute of a meta-built model holding the run seed its values are drawn from."""


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from the run seed and a tensor or module name (no
    ``hash()``: the same on every process)."""
    return (seed * 0x9E37_79B9_7F4A_7C15 + zlib.crc32(name.encode())) % (1 << 63)


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _owners(module: nn.Module) -> list[str]:
    """Names of the modules that register a floating-point tensor of their own."""
    out = []
    for name, m in module.named_modules():
        own = [*m._parameters.values(), *m._buffers.values()]
        if any(t is not None and t.is_floating_point() for t in own):
            out.append(name)
    return out


def uninitialisable(model: nn.Module) -> list[str]:
    """The modules whose tensors plait cannot initialise one at a time (see the module
    docstring): empty when the model has ``initial_value`` or ``_init_weights``."""
    if callable(getattr(model, "initial_value", None)) or callable(
        getattr(model, "_init_weights", None)
    ):
        return []
    modules = dict(model.named_modules())
    return [n or "<root>" for n in _owners(model) if not hasattr(modules[n], "reset_parameters")]


def initialisable(model: nn.Module) -> bool:
    """Whether :class:`InitialValues` can initialise every tensor of ``model``."""
    return not uninitialisable(model)


class InitialValues:
    """The initial value of every parameter and buffer of a one-device ``model`` (built
    on the meta device), by its one-device name, from ``seed`` (default: the model's
    :data:`SEED_ATTR`).

    Capture it before the model is changed (tensor parallelism replaces modules): it
    keeps the owner module of every name. :meth:`value` returns a CPU tensor of the
    tensor's full one-device shape (float32 from ``initial_value``; the tensor's own
    dtype from an owner's initialisers); the caller casts and slices it.
    """

    def __init__(self, model: nn.Module, seed: int | None = None) -> None:
        if seed is None:
            seed = getattr(model, SEED_ATTR, None)
        if not isinstance(seed, int):
            raise ConfigError(
                f"{type(model).__name__} is on the meta device but carries no seed: set "
                f"model.{SEED_ATTR} = <run seed> (plait.model.factory.build_meta_model does) "
                "so that every rank draws the same initial weights."
            )
        self.seed = seed
        self.model = model
        bad = uninitialisable(model)
        if bad:
            raise ConfigError(
                f"{type(model).__name__} cannot be initialised on the meta device: "
                f"{', '.join(bad[:5])} have no reset_parameters() and the model has no "
                "initial_value(name, seed, shape) or _init_weights(module); build it on a real "
                "device instead (see docs/models.md, 'Meta build')."
            )
        self._custom = getattr(model, "initial_value", None)
        self._hf_init = getattr(model, "_init_weights", None)
        self.owner: dict[str, tuple[str, nn.Module, str]] = {}
        """one-device name -> (owner module name, owner module, attribute)."""
        self.shape: dict[str, torch.Size] = {}
        """one-device name -> one-device shape."""
        modules = dict(model.named_modules())
        for mname, m in modules.items():
            for attr, t in [*m._parameters.items(), *m._buffers.items()]:
                if t is not None:
                    full = f"{mname}.{attr}" if mname else attr
                    self.owner.setdefault(full, (mname, m, attr))
                    self.shape.setdefault(full, t.shape)
        self._cache: tuple[str, dict[str, torch.Tensor]] | None = None

    @torch.no_grad()
    def value(self, name: str) -> torch.Tensor:
        """The full initial value of the tensor named ``name`` (CPU)."""
        if name not in self.owner:
            raise KeyError(f"{type(self.model).__name__} has no parameter or buffer {name!r}")
        if self._custom is not None:
            out: torch.Tensor = self._custom(name, self.seed, self.shape[name])
            return out
        mname, module, attr = self.owner[name]
        if self._cache is None or self._cache[0] != mname:
            self._cache = (mname, self._initialise(mname, module))
        return self._cache[1][attr]

    def _initialise(self, mname: str, module: nn.Module) -> dict[str, torch.Tensor]:
        """The owner's own tensors, allocated on the CPU and initialised (see the module
        docstring); refuses a floating value its initialisers left NaN."""
        twin: Any = copy.copy(module)  # shares children (meta: initialising them is a no-op)
        twin._parameters = {
            k: None if p is None else nn.Parameter(_blank(p), requires_grad=False)
            for k, p in module._parameters.items()
        }
        twin._buffers = {k: None if b is None else _blank(b) for k, b in module._buffers.items()}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(param_seed(self.seed, mname))
            reset = getattr(twin, "reset_parameters", None)
            if callable(reset):
                reset()
            if self._hf_init is not None:
                self._hf_init(twin)
        out: dict[str, torch.Tensor] = {}
        for k, t in [*twin._parameters.items(), *twin._buffers.items()]:
            if t is None:
                continue
            t = t.detach()
            if t.is_floating_point() and bool(t.isnan().any()):
                where = f"{mname}.{k}" if mname else k
                raise ConfigError(
                    f"{where}: no initialiser of {type(module).__name__} set it (give the "
                    "module a reset_parameters() that fills every tensor it registers)."
                )
            out[k] = t
        return out


def _blank(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor like ``t``: NaN when floating (what no initialiser touched shows),
    zeros otherwise; a real ``t`` (not meta) is copied as it is."""
    if not t.is_meta:
        return t.detach().to("cpu", copy=True)
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return out.fill_(float("nan")) if out.is_floating_point() else out.zero_()


def build_on_meta(fn: Any, *args: Any, seed: int, **kwargs: Any) -> nn.Module:
    """``fn(*args, **kwargs)`` built under ``torch.device("meta")`` (nothing allocated),
    marked with ``seed`` (:data:`SEED_ATTR`) for :class:`InitialValues`."""
    with torch.device("meta"):
        torch.manual_seed(seed)
        model = fn(*args, **kwargs)
    if isinstance(model, nn.Module):
        setattr(model, SEED_ATTR, seed)
    return model
