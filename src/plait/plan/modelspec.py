"""Model shapes the planner reasons about: parameter counts, tensors, FLOPs, presets.

A :class:`ModelSpec` describes a decoder-only transformer by shape alone. Two block
styles cover the presets:

* **llama** (plait's built-in model): RMSNorm, rotary positions, SwiGLU MLP, no biases,
  grouped-query attention.
* **gpt**: LayerNorm with bias, learned positions, GELU MLP of width 4h, biases on every
  linear layer (GPT-2, GPT-3, Megatron-LM's GPT).

Parameter counts are exact for both (tested against real modules built on the meta
device); the per-block terms and the FLOPs rule (PaLM, appendix B) are
:mod:`plait.arch`'s, the same the built-in model counts with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from plait.arch import (
    attention_flops_per_token,
    attention_params,
    mlp_params,
    training_flops_per_token,
)
from plait.config import PRESET_STYLES, ModelConfig, PresetStyle
from plait.config.presets import PRESETS, Preset
from plait.config.rules.choices import check_choice
from plait.errors import ConfigError

MAX_PARAMS = 1e15
"""Largest ``--params`` the planner models (bounds its time and memory)."""
MAX_LAYERS = 100_000
"""Most layers a model spec may have (the planner does per-layer arithmetic)."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer."""

    name: str
    """A label for reports."""
    n_layers: int
    """L: transformer blocks."""
    hidden: int
    """h: model width."""
    n_heads: int
    """a: query heads."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention; = n_heads for multi-head attention)."""
    ffn_hidden: int
    """f: width of the MLP's hidden layer (SwiGLU: of each of the gate and up branches)."""
    vocab: int
    """V: vocabulary size (the embedding and output head have V rows)."""
    style: PresetStyle = "llama"
    """Block style: ``llama`` (RMSNorm, RoPE, SwiGLU, no bias) or ``gpt`` (LayerNorm,
    learned positions, GELU, biases)."""
    max_positions: int = 2048
    """Longest sequence; the size of the learned position table for ``gpt``."""
    tie_embeddings: bool = False
    """The output head reuses the token-embedding matrix."""

    def __post_init__(self) -> None:
        for key in ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn_hidden", "vocab"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model {key} must be positive, got {getattr(self, key)}.")
        if self.max_positions <= 0:
            raise ConfigError(f"model max_positions must be positive, got {self.max_positions}.")
        if self.n_layers > MAX_LAYERS:
            raise ConfigError(
                f"model layers {self.n_layers:,} is more than the planner models "
                f"({MAX_LAYERS:,}: its per-layer arithmetic would take minutes and gigabytes)."
            )
        if self.hidden % self.n_heads:
            raise ConfigError(
                f"model hidden ({self.hidden}) must be divisible by heads ({self.n_heads})."
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model heads ({self.n_heads}) must be divisible by kv heads ({self.n_kv_heads})."
            )
        check_choice("model style", self.style, PRESET_STYLES)

    # ------------------------------------------------------------------ shape

    @property
    def head_dim(self) -> int:
        """d = h / a."""
        return self.hidden // self.n_heads

    @property
    def q_width(self) -> int:
        """Width of the query projection, a·d (= h)."""
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of each of the key and value projections."""
        return self.n_kv_heads * self.head_dim

    @property
    def bias(self) -> bool:
        """Whether linear layers and norms carry biases."""
        return self.style == "gpt"

    @property
    def mlp_mats(self) -> int:
        """Weight matrices in the MLP: 3 for SwiGLU, 2 for GELU."""
        return 3 if self.style == "llama" else 2

    # ------------------------------------------------------------------ parameters

    def layer_matmul_params(self) -> int:
        """Weights of one block's linear layers (no biases)."""
        h = self.hidden
        attn = attention_params(h, self.q_width, self.kv_width)
        return attn + mlp_params(h, self.ffn_hidden, self.mlp_mats)

    def layer_params(self) -> int:
        """Every parameter of one block: linear weights, biases and norm parameters."""
        h, f = self.hidden, self.ffn_hidden
        n = self.layer_matmul_params()
        if self.bias:
            n += self.q_width + 2 * self.kv_width + h  # q, k, v, o biases
            n += f + h  # fc1, fc2 biases
            n += 4 * h  # two LayerNorms: gain + bias
        else:
            n += 2 * h  # two RMSNorm gains
        return n

    def layer_tensors(self) -> int:
        """Parameter tensors of one block."""
        n = 4 + self.mlp_mats + 2  # attention weights, MLP weights, norm gains
        if self.bias:
            n += 4 + 2 + 2  # attention biases, MLP biases, norm biases
        return n

    def final_norm_params(self) -> int:
        """Parameters of the norm before the output head."""
        return 2 * self.hidden if self.bias else self.hidden

    def embedding_params(self) -> int:
        """Token embedding (and learned position table) parameters."""
        n = self.vocab * self.hidden
        if self.style == "gpt":
            n += self.max_positions * self.hidden
        return n

    def head_params(self) -> int:
        """Parameters of the output head that are not shared with the embedding."""
        return 0 if self.tie_embeddings else self.vocab * self.hidden

    def param_count(self) -> int:
        """Every parameter of the model (shared matrices counted once)."""
        return (
            self.n_layers * self.layer_params()
            + self.final_norm_params()
            + self.embedding_params()
            + self.head_params()
        )

    def tensor_count(self) -> int:
        """Parameter tensors of the model (shared ones counted once)."""
        n = self.n_layers * self.layer_tensors() + (2 if self.bias else 1) + 1
        if self.style == "gpt":
            n += 1  # position table
        if not self.tie_embeddings:
            n += 1
        return n

    # ------------------------------------------------------------------ FLOPs

    def matmul_params(self) -> int:
        """N of the 6N rule: weights of every matmul (blocks and output head, tied or
        not), not the embedding lookup, norms or biases."""
        return self.n_layers * self.layer_matmul_params() + self.vocab * self.hidden

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: ``6·N + 12·L·s·a·d`` (Chowdhery et al. 2022, PaLM,
        appendix B; causal mask not discounted): :func:`plait.arch.training_flops_per_token`,
        the rule :func:`plait.arch.flops_per_token` applies to plait's model."""
        return training_flops_per_token(self.matmul_params(), self.n_layers, seq_len, self.q_width)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """The attention part of :meth:`flops_per_token`: ``12·L·s·a·d``."""
        return attention_flops_per_token(self.n_layers, seq_len, self.q_width)

    # ------------------------------------------------------------------ conversions

    @classmethod
    def from_config(cls, cfg: ModelConfig, name: str = "custom") -> ModelSpec:
        """The spec of plait's built-in ``Transformer(cfg)``."""
        return cls(
            name=name,
            n_layers=cfg.n_layers,
            hidden=cfg.dim,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.kv_heads,
            ffn_hidden=cfg.hidden_dim,
            vocab=cfg.vocab_size,
            style="llama",
            max_positions=cfg.max_seq_len,
            tie_embeddings=cfg.tie_embeddings,
        )

    @classmethod
    def from_params(cls, params: float, vocab: int = 32000, seq: int = 2048) -> ModelSpec:
        """A llama-style shape with about ``params`` parameters.

        Shape rule (stated, not fitted): head dimension 128, aspect ratio h/L = 128
        (close to Llama 2 7B's 4096/32), SwiGLU width 8h/3 rounded up to 256, so that a
        block holds 12·h² weights. Kaplan et al. (2020, fig. 5) found loss nearly
        independent of the aspect ratio over a wide range, so the choice matters only
        for activation memory and communication, not for state bytes. The layer count
        is then adjusted so the total (with embedding and head) is closest to ``params``.
        """
        if not params > 0:
            raise ConfigError(f"--params must be positive, got {params}.")
        if params > MAX_PARAMS:
            raise ConfigError(
                f"--params {params:.3g} is more than the planner models ({MAX_PARAMS:.0e}, a "
                "thousand times the largest model trained so far); give a smaller model."
            )
        h = 128
        while True:
            layers = max(1, round(h / 128))
            if 12 * layers * (h + 128) ** 2 + 2 * vocab * (h + 128) > params:
                break
            h += 128
        f = 256 * math.ceil(8 * h / 3 / 256)
        base = cls(f"{params:.3g} params", 1, h, h // 128, h // 128, f, vocab, max_positions=seq)
        body = base.layer_params()
        layers = max(1, round((params - base.embedding_params() - base.head_params()) / body))
        return replace(base, n_layers=layers)


def _spec(name: str, preset: Preset) -> ModelSpec:
    """The planner's view of the preset ``name`` (the built-in model's for llama style)."""
    spec = ModelSpec.from_config(preset.config, name)
    return spec if preset.style == "llama" else replace(spec, style=preset.style)


MODEL_SPECS: dict[str, ModelSpec] = {name: _spec(name, p) for name, p in PRESETS.items()}
"""The planner's spec of every named shape, derived from :data:`plait.config.presets.PRESETS`."""


def model_spec_preset(name: str) -> ModelSpec:
    """The preset ``name``; unknown names are refused with the list."""
    if name not in MODEL_SPECS:
        raise ConfigError(
            f"unknown model preset {name!r}; choose one of "
            f"{', '.join(MODEL_SPECS)}, or give --params, or --layers --hidden --heads "
            "--vocab."
        )
    return MODEL_SPECS[name]
