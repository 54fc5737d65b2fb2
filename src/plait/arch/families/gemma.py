"""Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3's text model (``Gemma3ForCausalLM``,
``model_type`` 'gemma3_text').

Their block is Llama's with: RMSNorm gains ``(1 + w)`` (``norm_unit_offset``), the
embeddings times ``sqrt(hidden_size)`` (``embedding_scale``), GeGLU
(``hidden_activation`` 'gelu_pytorch_tanh'), four norms per block ('sandwich': input,
post-attention, pre- and post-feed-forward), the score scale
``query_pre_attn_scalar ** -0.5``, attention- and final-logit soft-capping, sliding
windows on the 'sliding_attention' layers; Gemma 3 adds the per-head q/k norm and a RoPE
per layer type (``rope_parameters`` nested by layer type: the sliding layers' unscaled
base is ``rope_local_theta``). The vision-language ``Gemma3ForConditionalGeneration``
is refused by name (:mod:`plait.arch.families.refused`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plait.arch.families.common import (
    ATTENTION_NAMES,
    MLP_NAMES,
    QK_NORM_NAMES,
    base_config,
    base_fields,
    limits,
    window_fields,
)
from plait.arch.spec import FamilySpec, Fields, HFConfig, refuse
from plait.config import ModelConfig

NORM_NAMES = (
    ("input_layernorm.weight", "attention_norm.weight"),
    ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    ("post_feedforward_layernorm.weight", "post_ffn_norm.weight"),
)
"""The four norms of a Gemma 2/3 block."""

GELU = "gelu_pytorch_tanh"


def _number(x: float | None) -> float | int | None:
    """An integral float as an int (transformers types ``query_pre_attn_scalar`` int)."""
    return int(x) if x is not None and float(x).is_integer() else x


def _softcap(hf: Mapping[str, Any], key: str, default: float | None) -> float | None:
    value = hf.get(key, default)
    return None if value is None else float(value)


def _gemma_fields(
    hf: Mapping[str, Any], source: str, spec: FamilySpec, caps: tuple[float | None, float | None]
) -> Fields:
    """What Gemma 2 and 3 share; ``caps``: transformers' defaults of the attention and
    final soft-caps when config.json leaves them out."""
    arch = spec.architecture
    act = hf.get("hidden_activation") or hf.get("hidden_act") or GELU
    if act != GELU:
        raise refuse(source, arch, f"activation {act!r}", f"plait's GeGLU is {GELU}")
    if hf.get("use_bidirectional_attention", False):
        raise refuse(source, arch, "bidirectional attention", "plait's attention is causal")
    sizes = {**hf, "hidden_act": "silu", "head_dim": hf.get("head_dim", 256)}
    base = base_fields(sizes, source, arch)
    window = window_fields(hf, gated=False)
    scalar = hf.get("query_pre_attn_scalar", 256)
    return {
        **base,
        **window,
        "attention_bias": "qkvo" if hf.get("attention_bias", False) else "none",
        "norm_placement": "sandwich",
        "norm_unit_offset": True,
        "embedding_scale": True,
        "activation": "gelu_tanh",
        "query_pre_attn_scalar": None if scalar is None else float(scalar),
        "attn_logit_softcap": _softcap(hf, "attn_logit_softcapping", caps[0]),
        "final_logit_softcap": _softcap(hf, "final_logit_softcapping", caps[1]),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "arch": spec.name,
    }


def _gemma_config(m: ModelConfig, spec: FamilySpec) -> HFConfig:
    out = base_config(m, spec)
    del out["hidden_act"]
    n = m.n_layers
    kinds = ["sliding_attention"] * n if m.sliding_window is not None else ["full_attention"] * n
    return {
        **out,
        "hidden_activation": GELU,
        "attention_bias": m.attention_bias == "qkvo",
        "sliding_window": m.sliding_window,
        "layer_types": list(m.layer_types or kinds),
        "query_pre_attn_scalar": _number(m.query_pre_attn_scalar or m.head_dim),
        "attn_logit_softcapping": m.attn_logit_softcap,
        "final_logit_softcapping": m.final_logit_softcap,
    }


def _fields2(hf: Mapping[str, Any], source: str) -> Fields:
    return _gemma_fields(hf, source, GEMMA2, (50.0, 30.0))


def _config2(m: ModelConfig) -> HFConfig:
    return _gemma_config(m, GEMMA2)


def _fields3(hf: Mapping[str, Any], source: str) -> Fields:
    """Gemma 3: the full-attention layers' RoPE from ``rope_parameters['full_attention']``
    (or the older top-level ``rope_theta``/``rope_scaling``), the sliding layers' base
    from ``rope_parameters['sliding_attention']`` (or ``rope_local_base_freq``)."""
    arch = GEMMA3.architecture
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = {**dict(hf.get("rope_scaling") or {}), **params}
        local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    kind = local.get("rope_type", local.get("type")) or "default"
    if kind != "default":
        raise refuse(
            source,
            arch,
            f"RoPE scaling {kind!r} on the sliding layers",
            "plait scales the full-attention layers' RoPE only",
        )
    flat = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta")}
    fields = _gemma_fields({**flat, "rope_parameters": full}, source, GEMMA3, (None, None))
    return {
        **fields,
        "qk_norm": "head",
        "rope_local_theta": float(local.get("rope_theta", 10000.0)),
    }


def _config3(m: ModelConfig) -> HFConfig:
    out = _gemma_config(m, GEMMA3)
    del out["rope_theta"]
    full = out.pop("rope_parameters")
    local = {"rope_type": "default", "rope_theta": m.rope_local_theta}
    return {**out, "rope_parameters": {"full_attention": full, "sliding_attention": local}}


_FEATURES = (
    "RMSNorm gain (1 + w) (norm_unit_offset), weights as stored by transformers",
    "embeddings times sqrt(hidden_size) (embedding_scale)",
    "GeGLU with gelu_pytorch_tanh (activation 'gelu_tanh')",
    "four norms per block (norm_placement 'sandwich')",
    "score scale query_pre_attn_scalar ** -0.5",
    "attention-logit soft-capping (sdpa path with explicit scores; not blockwise nor cp)",
    "final-logit soft-capping",
    "sliding windows on the 'sliding_attention' layers (layer_types)",
)
_REFUSES = (
    "bidirectional attention (use_bidirectional_attention)",
    "context parallelism (its kernels neither scale by query_pre_attn_scalar nor cap)",
)
_FREE = ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap")
_LIMITS: dict[str, tuple[Any, ...]] = {
    "attention_bias": ("none", "qkvo"),
    "norm_placement": ("sandwich",),
    "norm_unit_offset": (True,),
    "embedding_scale": (True,),
    "activation": ("gelu_tanh",),
}

GEMMA2 = FamilySpec(
    name="gemma2",
    architecture="Gemma2ForCausalLM",
    model_type="gemma2",
    features=_FEATURES,
    refuses=_REFUSES,
    to_fields=_fields2,
    to_config=_config2,
    names=ATTENTION_NAMES + MLP_NAMES + NORM_NAMES,
    expresses=limits(*_FREE, **_LIMITS, qk_norm=("none",), rope_local_theta=(None,)),
)

GEMMA3 = FamilySpec(
    name="gemma3",
    architecture="Gemma3ForCausalLM",
    model_type="gemma3_text",
    features=(
        *_FEATURES,
        "q/k RMSNorm per head (qk_norm 'head', gain 1 + w)",
        "RoPE per layer type: sliding layers rope_local_theta unscaled, full layers "
        "rope_theta with rope_scaling (rope_parameters nested by layer type)",
    ),
    refuses=(*_REFUSES, "a RoPE scaling on the sliding layers"),
    to_fields=_fields3,
    to_config=_config3,
    names=ATTENTION_NAMES + QK_NORM_NAMES + MLP_NAMES + NORM_NAMES,
    expresses=lambda m: (
        limits(*_FREE, "rope_local_theta", **_LIMITS, qk_norm=("head",))(m)
        or (None if m.rope_local_theta is not None else "model.rope_local_theta = None")
    ),
)
