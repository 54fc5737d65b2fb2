"""Rules on the model and its data: sequence length, the tokenizer's vocabulary, RoPE
scaling, pretrained models, mixture of experts.

See :mod:`plait.config.rules`.
"""

from __future__ import annotations

from collections.abc import Mapping

from plait.config.rules.choices import check_positive
from plait.errors import ConfigError


def check_seq_len(seq_len: int, max_seq_len: int) -> None:
    """Training sequences fit the model's rotary tables."""
    if seq_len > max_seq_len:
        raise ConfigError(
            f"train.seq_len ({seq_len}) exceeds model.max_seq_len ({max_seq_len}); raise "
            "model.max_seq_len or shorten train.seq_len."
        )


def check_tokenizer_vocab(tokenizer: str, vocab_size: int) -> None:
    """The byte tokenizer's 256 symbols fit the vocabulary."""
    if tokenizer == "byte" and vocab_size < 256:
        raise ConfigError(f"the byte tokenizer needs model.vocab_size >= 256, got {vocab_size}.")


def check_rope_scaling(kind: str, low_freq_factor: float, high_freq_factor: float) -> None:
    """'llama3' RoPE scaling smooths between two wavelengths: high_freq_factor must
    exceed low_freq_factor."""
    if kind == "llama3" and high_freq_factor <= low_freq_factor:
        raise ConfigError(
            f"model.rope_high_freq_factor ({high_freq_factor}) must exceed "
            f"model.rope_low_freq_factor ({low_freq_factor}) for rope_scaling 'llama3'."
        )


LAYER_TYPES = ("full_attention", "sliding_attention")
"""Hugging Face's names of the attention of one layer (``layer_types``)."""


def check_pretrained_model(
    given: Mapping[str, object], fixed: Mapping[str, object], source: str
) -> None:
    """Model flags ``given`` (``model.<field>`` -> value) must agree with the fields
    ``fixed`` by pretrained weights' ``config.json`` at ``source``; ``max_seq_len`` may be
    shorter (the rotary tables are cut, the weights do not change); ``factory`` is not
    loaded from pretrained weights."""
    if given.get("factory"):
        raise ConfigError(
            f"model.factory and train.init_from {source} (a Hugging Face model) both set: "
            "pretrained weights load into the built-in transformer or model.family hf-llama."
        )
    for key, want in fixed.items():
        have = given.get(key)
        if have is None or have == want:
            continue
        shorter = isinstance(have, int) and isinstance(want, int) and have <= want
        if key == "max_seq_len" and shorter:
            continue
        raise ConfigError(
            f"model.{key} = {have!r} contradicts {source}/config.json, which has {want!r}; "
            f"leave --model.{key} out (the pretrained model's sizes are used)."
        )


def check_moe(
    experts: int,
    top_k: int,
    every: int,
    shared: int,
    hidden: int | None,
    aux_coef: float,
    z_coef: float,
    capacity_factor: float,
    shared_gate: bool = False,
) -> None:
    """The mixture-of-experts fields of the model (``experts`` 0: dense, nothing else is
    read): k routed experts out of E, a positive layer period and widths, coefficients
    and capacity factor >= 0, a shared-expert gate only with shared experts."""
    if experts < 0:
        raise ConfigError(f"model.moe_experts must be >= 0 (0: dense), got {experts}.")
    if experts == 0:
        return
    if not 1 <= top_k <= experts:
        raise ConfigError(
            f"model.moe_top_k ({top_k}) must be between 1 and model.moe_experts ({experts})."
        )
    check_positive("model.", moe_every=every, moe_hidden_dim=hidden)
    for name, value in (
        ("moe_shared_experts", shared),
        ("moe_aux_loss_coef", aux_coef),
        ("moe_z_loss_coef", z_coef),
        ("moe_capacity_factor", capacity_factor),
    ):
        if value < 0:
            raise ConfigError(f"model.{name} must be >= 0, got {value}.")
    if shared_gate and shared == 0:
        raise ConfigError(
            "model.moe_shared_expert_gate gates the shared experts: set "
            "model.moe_shared_experts > 0 (or leave the gate off)."
        )


def check_moe_aux_scope(scope: str, aux_coef: float, experts: int, pp: int) -> None:
    """The model-wide load-balancing loss (``scope`` 'model', a positive weight) sums
    every MoE layer's routing counts before any layer's backward, which a pipeline's
    stages cannot (each holds some layers, and runs several micro-batches at once)."""
    if scope == "model" and aux_coef > 0 and experts > 0 and pp > 1:
        raise ConfigError(
            f"model.moe_aux_loss_scope='model' is refused with parallel.pp={pp}: the "
            "loss needs every MoE layer's routing counts before backward, which live on "
            "other pipeline stages; use moe_aux_loss_scope='layer' (each layer's own "
            "Switch loss) or pp=1."
        )


LAYER_TYPES = ("full_attention", "sliding_attention")
"""The per-layer attention kinds of ``model.layer_types`` (Hugging Face's names)."""


def check_attention_window(
    window: int | None, layer_types: tuple[str, ...] | None, n_layers: int
) -> None:
    """``model.sliding_window`` >= 1 and ``model.layer_types`` one known kind per layer."""
    if window is not None and window < 1:
        raise ConfigError(f"model.sliding_window must be >= 1 (None: no window), got {window}.")
    if layer_types is None:
        return
    if len(layer_types) != n_layers:
        raise ConfigError(
            f"model.layer_types has {len(layer_types)} entries; model.n_layers is {n_layers}."
        )
    unknown = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if unknown:
        raise ConfigError(
            f"model.layer_types: unknown kind(s) {', '.join(map(repr, unknown))}; "
            f"use {' or '.join(LAYER_TYPES)}."
        )


def check_softcap(cap: float | None, attention: str) -> None:
    """``model.attn_logit_softcap`` needs the explicit scores of the 'sdpa' path."""
    if cap is not None and attention != "sdpa":
        raise ConfigError(
            f"model.attn_logit_softcap needs model.attention = 'sdpa' (explicit scores); "
            f"the {attention!r} kernel does not soft-cap its scores."
        )
