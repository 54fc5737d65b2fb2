"""What the Llama-shaped families share: the config.json fields of the block plait
builds, RoPE, sliding windows, and the per-layer tensor names.

Each family module (:mod:`plait.arch.families`) builds its :class:`~plait.arch.spec.
FamilySpec` from these and adds its own fields and checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plait.arch.moe_hf import moe_config
from plait.arch.spec import FamilyError, FamilySpec, Fields, HFConfig, refuse
from plait.config import ModelConfig
from plait.errors import ConfigError

ATTENTION_NAMES = tuple(
    (f"self_attn.{p}_proj.{kind}", f"attention.w{p}.{kind}")
    for p in "qkvo"
    for kind in ("weight", "bias")
)
"""q/k/v/o projections and their biases (used when the model has them)."""

QK_NORM_NAMES = (
    ("self_attn.q_norm.weight", "attention.q_norm.weight"),
    ("self_attn.k_norm.weight", "attention.k_norm.weight"),
)
"""The query/key norms of Qwen3 (per head) and OLMo 2 (over the projection)."""

MLP_NAMES = (
    ("mlp.gate_proj.weight", "feed_forward.w1.weight"),
    ("mlp.up_proj.weight", "feed_forward.w3.weight"),
    ("mlp.down_proj.weight", "feed_forward.w2.weight"),
)
"""The SwiGLU feed-forward: gate, up, down."""

PRE_NORM_NAMES = (
    ("input_layernorm.weight", "attention_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
)
"""Llama's two pre-norms (its ``post_attention_layernorm`` is the norm before the MLP)."""

QWEN_MOE_NAMES = (
    ("mlp.gate.weight", "feed_forward.router.gate.weight"),
    ("mlp.shared_expert.gate_proj.weight", "feed_forward.shared.w1.weight"),
    ("mlp.shared_expert.up_proj.weight", "feed_forward.shared.w3.weight"),
    ("mlp.shared_expert.down_proj.weight", "feed_forward.shared.w2.weight"),
    ("mlp.shared_expert_gate.weight", "feed_forward.shared_gate.weight"),
)
"""Qwen2/Qwen3-MoE's router, shared expert and its gate (the latter two: Qwen2-MoE's);
the routed experts are many to one (:attr:`~plait.arch.spec.FamilySpec.experts`)."""

ROPE_REFUSED = {
    "yarn": "YaRN's attention-temperature and ramped frequencies are not implemented",
    "longrope": "LongRoPE's per-frequency short/long factors are not implemented",
    "dynamic": "dynamic NTK rescales the frequencies with the sequence length at run time",
}
"""RoPE scalings plait refuses, by name, and why."""


def rope_fields(hf: Mapping[str, Any], source: str, arch: str) -> Fields:
    """``rope_theta`` and the scaling (top level or transformers 5's ``rope_parameters``):
    'linear' and 'llama3' carried over; :data:`ROPE_REFUSED` and a partial rotary factor
    refused by name."""
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    kind = params.get("rope_type", params.get("type")) or "default"
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise refuse(
            source, arch, f"partial_rotary_factor {partial}", "plait rotates every channel"
        )
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    out: Fields = {"rope_theta": theta, "rope_scaling": "none"}
    if kind == "default":
        return out
    if kind not in ("linear", "llama3"):
        why = ROPE_REFUSED.get(kind, "plait carries over 'linear' and 'llama3' only")
        raise refuse(source, arch, f"RoPE scaling {kind!r}", why)
    out.update(rope_scaling=kind, rope_factor=float(params["factor"]))
    if kind == "llama3":
        out.update(
            rope_low_freq_factor=float(params["low_freq_factor"]),
            rope_high_freq_factor=float(params["high_freq_factor"]),
            rope_original_max_seq_len=int(params["original_max_position_embeddings"]),
        )
    return out


def base_fields(hf: Mapping[str, Any], source: str, arch: str) -> Fields:
    """The fields every Llama-shaped ``config.json`` fixes (sizes, RoPE, norm epsilon,
    tying, init std); refuses an activation other than SiLU and MLP biases."""
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise refuse(source, arch, f"activation {act!r}", "plait's MLP is SwiGLU")
    if hf.get("mlp_bias", False):
        raise refuse(source, arch, "MLP projections with biases", "plait's MLP has none")
    try:
        dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim")
        width = int(head_dim) if head_dim is not None else None
        fields: Fields = {
            "vocab_size": int(hf["vocab_size"]),
            "dim": dim,
            "n_layers": int(hf["num_hidden_layers"]),
            "n_heads": heads,
            "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
            "ffn_dim": int(hf["intermediate_size"]),
            "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
            "head_width": None if width is None or width * heads == dim else width,
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "init_std": float(hf.get("initializer_range", 0.02)),
        }
    except KeyError as e:
        raise FamilyError(f"{source}: config.json of {arch} has no {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise FamilyError(f"{source}: config.json of {arch} is malformed ({e})") from None
    return {**fields, **rope_fields(hf, source, arch)}


def window_fields(hf: Mapping[str, Any], gated: bool) -> Fields:
    """``sliding_window`` and ``layer_types`` from config.json. ``gated`` (Qwen2/3): the
    window applies only when ``use_sliding_window``, to layers from
    ``max_window_layers`` on (unless ``layer_types`` lists them)."""
    window = hf.get("sliding_window")
    if window is None or (gated and not hf.get("use_sliding_window", False)):
        return {"sliding_window": None, "layer_types": None}
    types = hf.get("layer_types")
    if types is None and gated:
        first = int(hf.get("max_window_layers", 0))
        n = int(hf["num_hidden_layers"])
        types = ["full_attention" if i < first else "sliding_attention" for i in range(n)]
    layer_types = tuple(types) if types is not None else None
    if layer_types is not None and all(t == "sliding_attention" for t in layer_types):
        layer_types = None  # HF's every-layer default
    return {"sliding_window": int(window), "layer_types": layer_types}


def window_config(m: ModelConfig, gated: bool) -> HFConfig:
    """The inverse of :func:`window_fields`."""
    n = m.n_layers
    types = list(m.layer_types or ["sliding_attention"] * n)
    if m.sliding_window is None:
        types = ["full_attention"] * n
    out: HFConfig = {"sliding_window": m.sliding_window}
    if gated:
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        out["use_sliding_window"] = m.sliding_window is not None
        if sliding:  # the first windowed layer (transformers' default otherwise)
            out["max_window_layers"] = sliding[0]
        out["layer_types"] = types
    elif m.layer_types is not None:
        out["layer_types"] = types
    return out


def base_config(m: ModelConfig, spec: FamilySpec) -> HFConfig:
    """The config.json entries every Llama-shaped family writes for ``m``."""
    rope = m.rope_scaling_entries() or {"rope_type": "default"}
    return {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "vocab_size": m.vocab_size,
        "hidden_size": m.dim,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "intermediate_size": m.hidden_dim,
        "max_position_embeddings": m.max_seq_len,
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_theta": m.rope_theta, **rope},
        "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings,
        "hidden_act": "silu",
        "initializer_range": m.init_std,
        "use_cache": True,
        # the tokenizer's ids are not the model's: None rather than a family default
        # outside the vocabulary (Phi-3's 32000)
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }


GEMMA_FEATURES: dict[str, Any] = {
    "norm_unit_offset": False,
    "embedding_scale": False,
    "activation": "silu",
    "query_pre_attn_scalar": None,
    "attn_logit_softcap": None,
    "final_logit_softcap": None,
    "rope_local_theta": None,
}
"""Gemma's block features at their off values: a family whose ``limits`` neither lists
nor frees one of them cannot hold it."""


def limits(*free: str, **allowed: tuple[Any, ...]) -> Any:
    """An ``expresses`` check: ``m``'s field values must be among ``allowed``'s, and each
    of :data:`GEMMA_FEATURES` not named in ``allowed`` nor ``free`` off."""
    off = {k: (v,) for k, v in GEMMA_FEATURES.items() if k not in allowed and k not in free}

    def expresses(m: ModelConfig) -> str | None:
        for field, values in {**off, **allowed}.items():
            have = getattr(m, field)
            if have not in values:
                return f"model.{field} = {have!r}"
        return None

    return expresses


def moe_checked(fields: Any, source: str) -> Fields:
    """Call ``fields()`` (:func:`plait.arch.moe_hf.moe_fields`), its ConfigError (a
    feature plait refuses) as a FamilyError."""
    try:
        out: Fields = fields()
    except FamilyError:
        raise
    except ConfigError as e:
        raise FamilyError(str(e) if source in str(e) else f"{source}: {e}") from None
    return out


def moe_expresses(dense: Any, family: Any) -> Any:
    """An MoE family's ``expresses``: the dense block's limits ``dense``, an MoE model,
    and :func:`plait.arch.moe_hf.moe_config`'s refusals (``family``: its model_type)."""

    def expresses(m: ModelConfig) -> str | None:
        bad: str | None = dense(m)
        if bad is not None:
            return bad
        if m.moe_experts == 0:
            return "model.moe_experts = 0 (a dense model)"
        try:
            moe_config(m, family)
        except ConfigError as e:
            return str(e)
        return None

    return expresses
