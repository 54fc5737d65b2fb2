"""Named model shapes: one table for the model and the planner.

:data:`PRESETS` is plain data in the config layer (no torch). Each entry is a
:class:`Preset`: the sizes as a :class:`~plait.config.ModelConfig` and the block style.

* ``llama`` shapes are what plait's built-in transformer builds (RMSNorm, rotary
  positions, SwiGLU MLP, no biases, grouped-query attention). :data:`MODEL_PRESETS` and
  :func:`model_preset` (re-exported by :mod:`plait.model`) hand these out as
  ``ModelConfig``\\ s.
* ``gpt`` shapes are published GPT-style architectures (LayerNorm with bias, learned
  positions, a GELU MLP of width 4h, biases on every linear layer) that the planner
  reasons about but plait does not build; their ``ffn_dim`` is that 4h width.

The planner (:data:`plait.plan.MODEL_SPECS`) derives its ``ModelSpec`` of every name
from this table, so a name means one shape everywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from plait.config import PRESET_STYLES, ModelConfig, PresetStyle
from plait.config.rules.choices import check_choice
from plait.errors import ConfigError


@dataclass(frozen=True)
class Preset:
    """One named model shape."""

    config: ModelConfig
    """Sizes: layers, width, heads, KV heads, MLP width, vocabulary, context, tying."""
    style: PresetStyle = "llama"
    """Block style; only ``llama`` shapes can be built by :class:`plait.model.Transformer`."""

    def __post_init__(self) -> None:
        check_choice("preset style", self.style, PRESET_STYLES)


def _gpt(layers: int, dim: int, heads: int, context: int, tied: bool) -> Preset:
    """A GPT-style shape: multi-head attention, GELU MLP of width 4·dim, vocab 50257."""
    cfg = ModelConfig(
        vocab_size=50257,
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        ffn_dim=4 * dim,
        max_seq_len=context,
        tie_embeddings=tied,
    )
    return Preset(cfg, "gpt")


def _llama(
    layers: int, dim: int, heads: int, kv: int, ffn: int, vocab: int, context: int, theta: float
) -> Preset:
    """A Llama shape (untied output head)."""
    cfg = ModelConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv if kv != heads else None,
        ffn_dim=ffn,
        max_seq_len=context,
        rope_theta=theta,
    )
    return Preset(cfg)


PRESETS: dict[str, Preset] = {
    # plait's own small shapes (tests, examples, the CPU)
    "tiny": Preset(
        ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    ),
    "small": Preset(ModelConfig()),
    # GPT-2 small's sizes built as plait's llama-style transformer (RoPE, SwiGLU; ffn 2048
    # = 8/3·768 gives the SwiGLU MLP the 4·h GELU MLP's size; vocabulary padded to a
    # multiple of 64). "gpt2-124m" below is GPT-2 itself.
    "gpt2-124m-llama": Preset(
        ModelConfig(
            vocab_size=50304,
            dim=768,
            n_layers=12,
            n_heads=12,
            ffn_dim=2048,
            max_seq_len=1024,
            tie_embeddings=True,
        )
    ),
    # GPT-2 (Radford et al. 2019): vocab 50257, 1024 positions, tied output head
    "gpt2-124m": _gpt(12, 768, 12, 1024, True),
    "gpt2-355m": _gpt(24, 1024, 16, 1024, True),
    "gpt2-774m": _gpt(36, 1280, 20, 1024, True),
    "gpt2-1.5b": _gpt(48, 1600, 25, 1024, True),
    # GPT-3 175B (Brown et al. 2020, table 2.1): 96 layers, h 12288, 96 heads, 2048 ctx
    "gpt3-175b": _gpt(96, 12288, 96, 2048, False),
    # Llama 2 (Touvron et al. 2023) and Llama 3 (Dubey et al. 2024, table 3)
    "llama2-7b": _llama(32, 4096, 32, 32, 11008, 32000, 4096, 10000.0),
    "llama2-13b": _llama(40, 5120, 40, 40, 13824, 32000, 4096, 10000.0),
    "llama2-70b": _llama(80, 8192, 64, 8, 28672, 32000, 4096, 10000.0),
    "llama3-8b": _llama(32, 4096, 32, 8, 14336, 128256, 8192, 500000.0),
    "llama3-70b": _llama(80, 8192, 64, 8, 28672, 128256, 8192, 500000.0),
    "llama3-405b": _llama(126, 16384, 128, 8, 53248, 128256, 8192, 500000.0),
}
"""Every named model shape, in the order ``plait plan --list`` prints them."""

MODEL_PRESETS: dict[str, ModelConfig] = {
    name: p.config for name, p in PRESETS.items() if p.style == "llama"
}
"""The shapes plait's built-in transformer builds. Use :func:`model_preset` for a copy."""


def model_preset(name: str) -> ModelConfig:
    """A private copy of the built-in transformer's preset ``name``.

    Raises :class:`ConfigError` for unknown names and for GPT-style shapes (which the
    planner knows but plait does not build), naming what would work.
    """
    preset = PRESETS.get(name)
    if preset is None:
        raise ConfigError(
            f"unknown model preset {name!r}; choose one of {', '.join(sorted(MODEL_PRESETS))}."
        )
    if preset.style != "llama":
        near = [n for n in MODEL_PRESETS if n.startswith(f"{name}-")]
        hint = f"use {near[0]!r} for its sizes as a llama-style model, or " if near else "use "
        raise ConfigError(
            f"model preset {name!r} is a GPT-style architecture (LayerNorm, GELU MLP, learned "
            f"positions) that the planner knows but plait's built-in transformer does not "
            f"build; {hint}one of {', '.join(sorted(MODEL_PRESETS))}."
        )
    return dataclasses.replace(preset.config)
