"""The Hugging Face format: ``config.json`` <-> :class:`ModelConfig`, and the name map.

A Hugging Face model folder holds ``config.json`` and its weights as safetensors, one
``model.safetensors`` or shards listed by ``model.safetensors.index.json``. Which
families plait reads and writes, and how, is data: one
:class:`~plait.arch.spec.FamilySpec` per family in :mod:`plait.arch.families` (Llama,
Mistral, Qwen2, Qwen3, Phi-3, OLMo 2, Mixtral, Qwen2-MoE, Qwen3-MoE; ``plait models``
prints the table), chosen by ``config.json``'s ``architectures`` on import and by
``model.arch`` on export. This module applies the spec: :func:`model_fields`
(config.json -> fields), :func:`hf_config` (fields -> config.json), :func:`hf_to_plait`
/ :func:`plait_to_hf` (names; an MoE family's routed experts, many stored tensors per
plait tensor, are :mod:`plait.checkpoint.hf_experts`'). The names of a Llama:

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
convention, so the q/k rows are taken as stored. A fused tensor (Phi-3's ``qkv_proj``,
``gate_up_proj``) holds several plait tensors' rows one after the other. With
``model.family = "hf"`` (old name ``hf-llama``) the model *is* transformers' class and
the names are Hugging Face's own (the identity map, fused tensors whole). This module
needs no torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from plait.arch.families import FAMILIES, family_named, family_of
from plait.arch.spec import TOP_NAMES, FamilyError, FamilySpec, concat_shape, hf_tensors
from plait.checkpoint.format import CheckpointError
from plait.config import ModelConfig
from plait.config.choices import HF_FAMILIES

HF_CONFIG = "config.json"
"""The model's configuration file in a Hugging Face folder."""

HF_INDEX = "model.safetensors.index.json"
"""The index of a sharded Hugging Face checkpoint (``weight_map``: tensor -> file)."""

HF_SINGLE = "model.safetensors"
"""The weights file of an unsharded Hugging Face checkpoint."""

SUPPORTED = tuple(spec.architecture for spec in FAMILIES.values())
"""Architectures plait loads (:data:`plait.arch.families.FAMILIES`)."""

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_PLAIT_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def _spec(family: str | FamilySpec) -> FamilySpec:
    return family if isinstance(family, FamilySpec) else family_named(family)


def hf_to_plait(name: str, family: str = "plait", arch: str | FamilySpec = "llama") -> str | None:
    """The model's name of the Hugging Face tensor ``name`` of family ``arch`` (None: not
    a weight plait keeps, e.g. an old ``rotary_emb.inv_freq`` buffer); ``family``
    'hf' (or 'hf-llama'): itself. A fused tensor maps to its first part
    (:func:`~plait.arch.spec.hf_tensors` lists every part)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if family in HF_FAMILIES:
        return name
    spec = _spec(arch)
    for hf, ours in TOP_NAMES:
        if name == hf:
            return ours
    m = _HF_LAYER.match(name)
    if m is not None:
        for hf, ours in spec.names:
            if m.group(2) == hf:
                return f"layers.{m.group(1)}.{ours}"
        for hf, parts in spec.fused:
            if m.group(2) == hf:
                return f"layers.{m.group(1)}.{parts[0]}"
    raise CheckpointError(
        f"Hugging Face tensor {name!r} has no place in plait's transformer ({spec.architecture})"
    )


def plait_to_hf(name: str, family: str = "plait", arch: str | FamilySpec = "llama") -> str:
    """The Hugging Face name of the model's tensor ``name`` in family ``arch`` (the fused
    tensor holding it, for Phi-3's q/k/v and gate/up); inverse of :func:`hf_to_plait`."""
    if family in HF_FAMILIES:
        return name
    spec = _spec(arch)
    for hf, ours in TOP_NAMES:
        if name == ours:
            return hf
    m = _PLAIT_LAYER.match(name)
    if m is not None:
        for hf, ours in spec.names:
            if m.group(2) == ours:
                return f"model.layers.{m.group(1)}.{hf}"
        for hf, parts in spec.fused:
            if m.group(2) in parts:
                return f"model.layers.{m.group(1)}.{hf}"
    raise CheckpointError(f"plait tensor {name!r} has no Hugging Face {spec.architecture} name")


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


def model_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The :class:`ModelConfig` fields that Hugging Face ``config.json`` ``hf`` fixes (its
    family's :attr:`~plait.arch.spec.FamilySpec.to_fields`), or CheckpointError naming
    what plait cannot load."""
    try:
        return family_of(hf, source).to_fields(hf, source)
    except FamilyError as e:
        raise CheckpointError(str(e)) from None


def pretrained_config(folder: str | Path, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of the Hugging Face model in ``folder`` (``overrides``:
    other fields, e.g. ``family="hf-llama"`` or a shorter ``max_seq_len``)."""
    return ModelConfig(**{**model_fields(read_hf_config(folder), str(folder)), **overrides})


def hf_shapes(m: ModelConfig) -> dict[str, list[int]]:
    """The Hugging Face name and shape of every weight of the ``model.arch`` family's
    model of ``m`` (a fused tensor: its parts' rows together)."""
    spec = _spec(m.arch)
    return {hf: concat_shape(parts) for hf, parts in hf_tensors(spec, m).items()}


def hf_config(m: ModelConfig, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of the ``model.arch`` family's model with the sizes of ``m``,
    weights stored as ``dtype`` ("float32", "bfloat16"); CheckpointError when that family
    cannot hold one of ``m``'s features."""
    spec = _spec(m.arch)
    bad = spec.expresses(m)
    if bad is not None:
        raise CheckpointError(
            f"{spec.architecture} cannot hold {bad}; plait's families are listed by plait models"
        )
    return {**spec.to_config(m), "torch_dtype": dtype, "dtype": dtype}
