"""The Hugging Face format: ``config.json`` <-> :class:`ModelConfig`, and the name map.

A Hugging Face model folder holds ``config.json`` and its weights as safetensors, one
``model.safetensors`` or shards listed by ``model.safetensors.index.json``. plait reads
and writes the Llama family (``LlamaForCausalLM``; ``MistralForCausalLM`` without a
sliding window), whose block is exactly plait's built-in one:

=====================================================  ===================================
Hugging Face name                                      plait's built-in transformer
=====================================================  ===================================
``model.embed_tokens.weight``                          ``tok_embeddings.weight``
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``   ``layers.{i}.attention.w{q,k,v,o}.weight``
``model.layers.{i}.mlp.gate_proj.weight``              ``layers.{i}.feed_forward.w1.weight``
``model.layers.{i}.mlp.up_proj.weight``                ``layers.{i}.feed_forward.w3.weight``
``model.layers.{i}.mlp.down_proj.weight``              ``layers.{i}.feed_forward.w2.weight``
``model.layers.{i}.input_layernorm.weight``            ``layers.{i}.attention_norm.weight``
``model.layers.{i}.post_attention_layernorm.weight``   ``layers.{i}.ffn_norm.weight``
``model.norm.weight``                                  ``norm.weight``
``lm_head.weight`` (absent when tied)                  ``output.weight``
=====================================================  ===================================

No tensor changes layout: plait's rotary embedding pairs channel ``j`` with ``j +
head_dim/2`` of each head (``apply_rotary``), which is Hugging Face's ``rotate_half``
convention, so the q/k rows are taken as stored (the interleaved-pair permutation is
only needed for Meta's original ``consolidated.*.pth`` files, which plait does not
read). With ``model.family = "hf-llama"`` the model *is* ``LlamaForCausalLM`` and the
names are Hugging Face's own (the identity map).

Refused, by name: any other architecture (Qwen2's q/k/v biases, Gemma's norms, ...),
q/k/v/o or MLP biases, an activation other than SiLU, a head dimension other than
``hidden_size / num_attention_heads``, RoPE scaling other than ``linear`` and Llama
3.1's ``llama3`` (``dynamic``, ``yarn``, ``longrope``: carried over are ``rope_theta``
and those two, into ``model.rope_scaling`` and ``model.rope_*``) and a Mistral sliding
window. This module needs no torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from plait.checkpoint.format import CheckpointError
from plait.config import ModelConfig

HF_CONFIG = "config.json"
"""The model's configuration file in a Hugging Face folder."""

HF_INDEX = "model.safetensors.index.json"
"""The index of a sharded Hugging Face checkpoint (``weight_map``: tensor -> file)."""

HF_SINGLE = "model.safetensors"
"""The weights file of an unsharded Hugging Face checkpoint."""

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM")
"""Architectures whose block is plait's (RMSNorm, GQA with rotate-half RoPE, SwiGLU)."""

_WHY_NOT = {
    "Qwen2ForCausalLM": "its q/k/v projections have biases, which plait's transformer has not",
    "GemmaForCausalLM": "its RMSNorm gain is (1 + weight) and its embeddings are scaled",
    "Phi3ForCausalLM": "its q/k/v and gate/up projections are fused",
    "MixtralForCausalLM": "its feed-forward is a mixture of experts",
}

_LAYER = [  # (Hugging Face suffix, plait suffix) inside model.layers.{i}
    ("self_attn.q_proj.weight", "attention.wq.weight"),
    ("self_attn.k_proj.weight", "attention.wk.weight"),
    ("self_attn.v_proj.weight", "attention.wv.weight"),
    ("self_attn.o_proj.weight", "attention.wo.weight"),
    ("mlp.gate_proj.weight", "feed_forward.w1.weight"),
    ("mlp.up_proj.weight", "feed_forward.w3.weight"),
    ("mlp.down_proj.weight", "feed_forward.w2.weight"),
    ("input_layernorm.weight", "attention_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
]
_TOP = [
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
]
_TO_PLAIT = {hf: ours for hf, ours in _LAYER}
_TO_HF = {ours: hf for hf, ours in _LAYER}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_PLAIT_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_to_plait(name: str, family: str = "plait") -> str | None:
    """The model's name of Hugging Face tensor ``name`` (None: not a weight plait
    keeps, e.g. an old ``rotary_emb.inv_freq`` buffer). ``family`` 'hf-llama': itself."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if family == "hf-llama":
        return name
    for hf, ours in _TOP:
        if name == hf:
            return ours
    m = _HF_LAYER.match(name)
    if m is not None and m.group(2) in _TO_PLAIT:
        return f"layers.{m.group(1)}.{_TO_PLAIT[m.group(2)]}"
    raise CheckpointError(f"Hugging Face tensor {name!r} has no place in plait's transformer")


def plait_to_hf(name: str, family: str = "plait") -> str:
    """The Hugging Face name of the model's tensor ``name`` (inverse of :func:`hf_to_plait`)."""
    if family == "hf-llama":
        return name
    for hf, ours in _TOP:
        if name == ours:
            return hf
    m = _PLAIT_LAYER.match(name)
    if m is not None and m.group(2) in _TO_HF:
        return f"model.layers.{m.group(1)}.{_TO_HF[m.group(2)]}"
    raise CheckpointError(f"plait tensor {name!r} has no Hugging Face Llama name")


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """``config.json`` of a Hugging Face model folder (CheckpointError: none, unreadable)."""
    path = Path(folder) / HF_CONFIG
    if not path.is_file():
        raise CheckpointError(
            f"{folder} is not a Hugging Face model folder: it has no {HF_CONFIG} (nor is it "
            "a plait checkpoint: no metadata.json)"
        )
    try:
        data = json.loads(path.read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is unreadable ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return data


def _rope(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The rotary fields: ``rope_theta`` and the scaling (top level, or in transformers
    5's ``rope_parameters``); 'linear' and 'llama3' are carried over, others refused."""
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    kind = params.get("rope_type", params.get("type")) or "default"
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    out: dict[str, Any] = {"rope_theta": theta, "rope_scaling": "none"}
    if kind == "default":
        return out
    if kind not in ("linear", "llama3"):
        raise CheckpointError(
            f"{source}: RoPE scaling {kind!r} is not supported (plait carries over "
            "'linear' and 'llama3' only)"
        )
    out.update(rope_scaling=kind, rope_factor=float(params["factor"]))
    if kind == "llama3":
        out.update(
            rope_low_freq_factor=float(params["low_freq_factor"]),
            rope_high_freq_factor=float(params["high_freq_factor"]),
            rope_original_max_seq_len=int(params["original_max_position_embeddings"]),
        )
    return out


def model_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The :class:`ModelConfig` fields that Hugging Face ``config.json`` ``hf`` fixes,
    or CheckpointError naming what plait cannot load."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else f"model_type {hf.get('model_type')!r}"
    if arch not in SUPPORTED:
        why = _WHY_NOT.get(arch, "its block is not Llama's")
        raise CheckpointError(
            f"{source}: architecture {arch} is not supported ({why}); plait loads "
            f"{', '.join(SUPPORTED)}"
        )
    refuse = [
        (hf.get("attention_bias", False), "attention projections with biases"),
        (hf.get("mlp_bias", False), "MLP projections with biases"),
        (hf.get("hidden_act", "silu") != "silu", f"activation {hf.get('hidden_act')!r}"),
        (hf.get("sliding_window") is not None, "a sliding attention window"),
    ]
    for bad, what in refuse:
        if bad:
            raise CheckpointError(f"{source}: {arch} with {what} is not supported by plait")
    dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != dim:
        raise CheckpointError(
            f"{source}: head_dim {head_dim} is not hidden_size / num_attention_heads "
            f"({dim} / {heads}); plait derives the head width from dim and n_heads"
        )
    return {
        "vocab_size": int(hf["vocab_size"]),
        "dim": dim,
        "n_layers": int(hf["num_hidden_layers"]),
        "n_heads": heads,
        "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "ffn_dim": int(hf["intermediate_size"]),
        "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
        **_rope(hf, source),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def pretrained_config(folder: str | Path, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of the Hugging Face model in ``folder`` (``overrides``:
    other fields, e.g. ``family="hf-llama"`` or a shorter ``max_seq_len``)."""
    return ModelConfig(**{**model_fields(read_hf_config(folder), str(folder)), **overrides})


def hf_shapes(m: ModelConfig) -> dict[str, list[int]]:
    """The Hugging Face name and shape of every weight of the Llama of ``m``."""
    kv, hd, ffn = m.kv_heads * m.head_dim, m.head_dim, m.hidden_dim
    out = {"model.embed_tokens.weight": [m.vocab_size, m.dim]}
    for i in range(m.n_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = [m.n_heads * hd, m.dim]
        out[p + "self_attn.k_proj.weight"] = [kv, m.dim]
        out[p + "self_attn.v_proj.weight"] = [kv, m.dim]
        out[p + "self_attn.o_proj.weight"] = [m.dim, m.n_heads * hd]
        out[p + "mlp.gate_proj.weight"] = [ffn, m.dim]
        out[p + "mlp.up_proj.weight"] = [ffn, m.dim]
        out[p + "mlp.down_proj.weight"] = [m.dim, ffn]
        out[p + "input_layernorm.weight"] = [m.dim]
        out[p + "post_attention_layernorm.weight"] = [m.dim]
    out["model.norm.weight"] = [m.dim]
    if not m.tie_embeddings:
        out["lm_head.weight"] = [m.vocab_size, m.dim]
    return out


def _rope_parameters(m: ModelConfig) -> dict[str, Any]:
    """The scaling entries of ``rope_parameters`` (the inverse of :func:`_rope`)."""
    return m.rope_scaling_entries() or {"rope_type": "default"}


def hf_config(m: ModelConfig, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` with the sizes of ``m``, weights
    stored as ``dtype`` ("float32", "bfloat16")."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.dim,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "intermediate_size": m.hidden_dim,
        "max_position_embeddings": m.max_seq_len,
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_theta": m.rope_theta, **_rope_parameters(m)},
        "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": m.init_std,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }
