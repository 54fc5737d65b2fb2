"""Which model a run trains: the built-in transformer, a Hugging Face Llama, or yours.

``model.factory = "package.module:function"`` names your own model: the function is
called as ``function(model_config)`` (the run's :class:`~plait.config.ModelConfig`, so it
may read the size fields or ignore them) after ``torch.manual_seed(train.seed)`` and
returns an ``nn.Module`` that maps token ids ``(batch, seq)`` to logits
``(batch, seq, vocab)`` -- or to an output object with ``.logits`` (Hugging Face style)
or a tuple whose first element is the logits; :func:`logits_of` adapts those. The
trainer calls it under ``torch.device("meta")`` (:func:`build_meta_model`) and
``parallelize`` allocates and initialises only each rank's pieces, from the seed and the
tensors' names (:mod:`plait.model.init`), so every layout starts from the same weights;
:func:`build_model` is the eager, full one-device build.

``model.family = "hf-llama"`` builds ``transformers.LlamaForCausalLM`` from the size
fields (:mod:`plait.model.hf_llama`). Without either, plait's own
:class:`~plait.model.transformer.Transformer`.

A model may carry its tensor-parallel plan as data in the attribute
``plait_tp_plan`` (rows ``(module pattern, style)``, see
:mod:`plait.parallel.tensor.sharding_plan`); ``parallelize`` uses it when no plan is passed.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.arch import flops_per_token, param_count
from plait.config import ModelConfig
from plait.config.choices import HF_FAMILIES
from plait.errors import ConfigError
from plait.model.init import build_on_meta, uninitialisable
from plait.model.transformer import Transformer


def load_factory(path: str) -> Callable[[ModelConfig], nn.Module]:
    """The function ``path`` (``'package.module:function'``) names. The current folder
    is searched after ``sys.path`` (as ``python -m`` does), so a ``mypkg/`` next to where
    ``plait train`` runs is found. Raises :class:`ConfigError` naming what is missing."""
    module_name, _, attr = path.partition(":")
    if not (module_name and attr):
        raise ConfigError(f"model.factory must be 'package.module:function', got {path!r}.")
    try:
        module = _import(module_name)
    except ImportError as e:
        raise ConfigError(
            f"model.factory {path!r}: cannot import {module_name!r} ({e}); the module must "
            "be installed, on PYTHONPATH or in the current folder."
        ) from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"model.factory {path!r}: {module_name} has no attribute {attr!r}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"model.factory {path!r}: {attr} is not callable.")
    return obj


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        here = os.getcwd()
        top = name.partition(".")[0]
        if e.name != top or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)  # the current folder, searched last
        return importlib.import_module(name)


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The full one-device model of ``cfg`` (factory, family), initialised from
    ``seed``; raises :class:`ConfigError` when it cannot be built."""
    if cfg.factory is not None:
        fn = load_factory(cfg.factory)
        torch.manual_seed(seed)
        model = fn(cfg)
        if not isinstance(model, nn.Module):
            raise ConfigError(
                f"model.factory {cfg.factory!r} returned {type(model).__name__}, not an nn.Module."
            )
        return model
    if cfg.family in HF_FAMILIES:
        from plait.model.hf_llama import build_hf_llama

        torch.manual_seed(seed)
        return build_hf_llama(cfg)
    return Transformer(cfg, seed=seed)


def build_meta_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The model of ``cfg`` built on the meta device (nothing allocated), carrying
    ``seed``: ``parallelize`` allocates and initialises only each rank's pieces, with the
    values of :class:`~plait.model.init.InitialValues` (the built-in transformer: bit for
    bit :func:`build_model`'s weights).

    A factory model plait cannot initialise one tensor at a time (a module with its own
    parameters and no ``reset_parameters()``, and no model-level ``initial_value`` or
    ``_init_weights``) is built in full by :func:`build_model` instead, with a
    :class:`UserWarning` naming the modules and the memory every rank then needs."""
    if cfg.factory is not None:
        fn = load_factory(cfg.factory)
        model = build_on_meta(fn, cfg, seed=seed)
        if not isinstance(model, nn.Module):
            raise ConfigError(
                f"model.factory {cfg.factory!r} returned {type(model).__name__}, not an nn.Module."
            )
        bad = uninitialisable(model)
        if bad:
            size = sum(p.numel() for p in model.parameters()) * 4
            warnings.warn(
                f"model.factory {cfg.factory}: {', '.join(bad[:5])} "
                f"{'has' if len(bad) == 1 else 'have'} no reset_parameters() and the model "
                "has no initial_value(name, seed, shape) or _init_weights(module), so plait "
                "cannot initialise it shard by shard: every rank builds the full model first "
                f"({size / 2**30:.2f} GiB in float32). Give those modules a "
                "reset_parameters() (docs/models.md, 'Meta build').",
                UserWarning,
                stacklevel=2,
            )
            return build_model(cfg, seed)
        return model
    if cfg.family in HF_FAMILIES:
        from plait.model.hf_llama import build_hf_llama

        return build_on_meta(build_hf_llama, cfg, seed=seed)
    return build_on_meta(Transformer, cfg, seed=seed)


def check_model(cfg: ModelConfig) -> None:
    """What can be checked before any rank starts: the factory imports and is callable,
    transformers is installed for ``hf-llama`` and the sizes map onto a LlamaConfig."""
    if cfg.factory is not None:
        load_factory(cfg.factory)
    elif cfg.family in HF_FAMILIES:
        from plait.model.hf_llama import llama_config

        llama_config(cfg)


def is_builtin(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` builds plait's own Transformer (no factory, family 'plait')."""
    return cfg.factory is None and cfg.family == "plait"


def describe_model(model: nn.Module, cfg: ModelConfig) -> str:
    """A few words naming the model for the run's banner."""
    if cfg.factory is not None:
        return f"{type(model).__name__} from model.factory {cfg.factory}"
    what = f"Hugging Face {type(model).__name__}, " if cfg.family in HF_FAMILIES else ""
    return f"{what}{cfg.n_layers} layers, dim {cfg.dim}"


def model_params(model: nn.Module, cfg: ModelConfig) -> int:
    """Parameters of the full one-device model (shared tensors counted once)."""
    if is_builtin(cfg):
        return param_count(cfg)
    return sum(p.numel() for p in model.parameters())  # parameters() skips duplicates


def model_flops_per_token(model: nn.Module, cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: the built-in formula for the built-in transformer and
    the Llama family (same matmuls); ``6·N`` (every parameter a matmul weight, attention
    not counted) for a factory model, whose structure plait does not know."""
    if cfg.factory is None:
        return flops_per_token(cfg, seq_len)
    return 6.0 * model_params(model, cfg)


def logits_of(out: Any) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, its ``.logits`` (a Hugging
    Face ``CausalLMOutput``) or the first element of a tuple or list."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(
        f"the model returned {type(out).__name__}; plait's loss needs logits (batch, seq, "
        "vocab): return a tensor, an output with .logits, or a tuple whose first element "
        "is the logits (or pass parallelize(..., loss_fn=...))."
    )
