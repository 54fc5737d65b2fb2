"""An architecture as data: one :class:`FamilySpec` per Hugging Face family.

A spec says, for one ``transformers`` causal-LM class (``architecture``, ``model_type``):
which block features of the built-in transformer it turns on (``features``, prose for
``plait models``), how its ``config.json`` maps to :class:`~plait.config.ModelConfig`
fields and back (``to_fields``, ``to_config``), how its tensors are named
(``names``: Hugging Face suffix inside ``model.layers.{i}`` -> plait suffix inside
``layers.{i}``; ``fused``: one Hugging Face tensor holding several plait tensors' rows,
split on import and concatenated on export) and what it refuses (``refuses``, prose;
the checks raise :class:`FamilyError` naming the feature). Families plait knows but
does not load are :class:`Refused` rows: a name and a reason.

Read by the import (:mod:`plait.checkpoint.hf`, :mod:`plait.checkpoint.hf_read`), the
export (:mod:`plait.checkpoint.hf_export`), the parameter count
(:mod:`plait.arch.arithmetic` counts the features' vectors) and ``plait models``. Adding a
family is one module in :mod:`plait.arch.families` plus its tests. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from plait.config import ModelConfig
from plait.config.model import expert_hidden_dim, is_moe_layer
from plait.errors import ConfigError

Fields = dict[str, Any]
HFConfig = dict[str, Any]


class FamilyError(ConfigError):
    """A ``config.json`` (or a model) that a family spec cannot map: an unknown
    architecture, a feature plait does not do, a value out of range."""


@dataclass(frozen=True)
class FamilySpec:
    """One supported family (see the module docstring)."""

    name: str
    """plait's short name (``model.arch``): 'llama', 'qwen2', ..."""
    architecture: str
    """The ``architectures[0]`` of its ``config.json`` (``Qwen2ForCausalLM``)."""
    model_type: str
    """Its ``config.json`` ``model_type``."""
    features: tuple[str, ...]
    """The block features it turns on, in words."""
    refuses: tuple[str, ...]
    """What of the family plait refuses, and why, in words."""
    to_fields: Callable[[Mapping[str, Any], str], Fields]
    """``(config.json, source) -> ModelConfig fields`` (FamilyError: refused)."""
    to_config: Callable[[ModelConfig], HFConfig]
    """``ModelConfig -> config.json`` (without the dtype entries)."""
    names: tuple[tuple[str, str], ...]
    """``(Hugging Face suffix, plait suffix)`` of each per-layer tensor kept as is."""
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """``(Hugging Face suffix, plait suffixes)``: rows of the plait tensors, in order."""
    expresses: Callable[[ModelConfig], str | None] = lambda m: None
    """None when the family can hold ``m``; else the feature it cannot (export)."""
    experts: Literal["mixtral", "qwen"] | None = None
    """MoE families: whose hub names the routed experts carry (one ``(f, dim)`` or
    ``(dim, f)`` tensor per expert and projection, transposed and stacked into plait's
    ``experts.w1/w3/w2``: many to one, read by :mod:`plait.checkpoint.hf_experts`);
    None: a dense family. The MoE layers' other tensors (router, shared expert, its
    gate) are in :attr:`names`."""


@dataclass(frozen=True)
class Refused:
    """A family plait knows by name and does not load, with the reason."""

    name: str
    architecture: str
    model_type: str
    reason: str


TOP_NAMES = (
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
)
"""The tensors outside the blocks, the same in every family (``lm_head`` absent when tied)."""


EXPERT_TENSORS = ("w1", "w3", "w2")
"""plait's stacked routed-expert tensors of an MoE layer (``feed_forward.experts.*``)."""


def is_expert_tensor(name: str) -> bool:
    """Whether plait's ``name`` is a stacked routed-expert tensor (no one-to-one HF name)."""
    return ".feed_forward.experts." in name


def _moe_shapes(m: ModelConfig, p: str) -> dict[str, list[int]]:
    """The feed-forward of MoE layer prefix ``p``: router ``(E, dim)``, experts
    ``w1``/``w3`` ``(E, dim, f)`` and ``w2`` ``(E, f, dim)``, the shared experts (``s·f``
    wide) and Qwen2-MoE's ``(1, dim)`` shared gate."""
    e, d = m.moe_experts, m.dim
    f = expert_hidden_dim(m)
    out = {
        p + "feed_forward.router.gate.weight": [e, d],
        p + "feed_forward.experts.w1": [e, d, f],
        p + "feed_forward.experts.w3": [e, d, f],
        p + "feed_forward.experts.w2": [e, f, d],
    }
    if m.moe_shared_experts > 0:
        s = m.moe_shared_experts * f
        out[p + "feed_forward.shared.w1.weight"] = [s, d]
        out[p + "feed_forward.shared.w3.weight"] = [s, d]
        out[p + "feed_forward.shared.w2.weight"] = [d, s]
    if m.moe_shared_expert_gate:
        out[p + "feed_forward.shared_gate.weight"] = [1, d]
    return out


def plait_shapes(m: ModelConfig) -> dict[str, list[int]]:
    """The name and shape of every parameter of ``Transformer(m)`` (dense and MoE
    blocks)."""
    q, kv, hd = m.n_heads * m.head_dim, m.kv_heads * m.head_dim, m.head_dim
    out: dict[str, list[int]] = {"tok_embeddings.weight": [m.vocab_size, m.dim]}
    for i in range(m.n_layers):
        p = f"layers.{i}."
        out[p + "attention_norm.weight"] = [m.dim]
        for w, rows in (("wq", q), ("wk", kv), ("wv", kv)):
            out[p + f"attention.{w}.weight"] = [rows, m.dim]
            if m.attention_bias != "none":
                out[p + f"attention.{w}.bias"] = [rows]
        out[p + "attention.wo.weight"] = [m.dim, q]
        if m.attention_bias == "qkvo":
            out[p + "attention.wo.bias"] = [m.dim]
        if m.qk_norm != "none":
            per_head = m.qk_norm == "head"
            out[p + "attention.q_norm.weight"] = [hd if per_head else q]
            out[p + "attention.k_norm.weight"] = [hd if per_head else kv]
        if m.norm_placement == "sandwich":
            out[p + "post_attention_norm.weight"] = [m.dim]
        out[p + "ffn_norm.weight"] = [m.dim]
        if m.norm_placement == "sandwich":
            out[p + "post_ffn_norm.weight"] = [m.dim]
        if is_moe_layer(m, i):
            out.update(_moe_shapes(m, p))
            continue
        out[p + "feed_forward.w1.weight"] = [m.hidden_dim, m.dim]
        out[p + "feed_forward.w3.weight"] = [m.hidden_dim, m.dim]
        out[p + "feed_forward.w2.weight"] = [m.dim, m.hidden_dim]
    out["norm.weight"] = [m.dim]
    if not m.tie_embeddings:
        out["output.weight"] = [m.vocab_size, m.dim]
    return out


def hf_tensors(spec: FamilySpec, m: ModelConfig) -> dict[str, list[tuple[str, list[int]]]]:
    """Every Hugging Face tensor of the family's model of ``m``: its name -> the plait
    tensors ``(name, shape)`` whose rows it holds, in order (one for an unfused tensor).
    The routed experts of an MoE family are not here (many to one:
    :func:`expert_tensors`)."""
    shapes = plait_shapes(m)
    to_hf = {ours: hf for hf, ours in spec.names}
    fused = {ours: hf for hf, parts in spec.fused for ours in parts}
    out: dict[str, list[tuple[str, list[int]]]] = {}
    top = {ours: hf for hf, ours in TOP_NAMES}
    for name, shape in shapes.items():
        if name in top:
            out[top[name]] = [(name, shape)]
            continue
        if spec.experts is not None and is_expert_tensor(name):
            continue
        _, i, suffix = name.split(".", 2)
        hf = to_hf.get(suffix) or fused.get(suffix)
        if hf is None:
            raise FamilyError(f"{spec.architecture} has no tensor for plait's {name}")
        out.setdefault(f"model.layers.{i}.{hf}", []).append((name, shape))
    return out


def expert_tensors(spec: FamilySpec, m: ModelConfig) -> dict[str, list[int]]:
    """The stacked routed-expert tensors of the MoE family's model of ``m``: plait name
    -> shape (their Hugging Face tensors: :mod:`plait.checkpoint.hf_experts`)."""
    if spec.experts is None:
        return {}
    return {n: s for n, s in plait_shapes(m).items() if is_expert_tensor(n)}


def concat_shape(parts: list[tuple[str, list[int]]]) -> list[int]:
    """The shape of a tensor holding ``parts``' rows one after the other."""
    first = parts[0][1]
    return [sum(s[0] for _, s in parts), *first[1:]]


def refuse(source: str, arch: str, what: str, why: str) -> FamilyError:
    """The one-line error for a feature ``what`` of ``arch`` that plait does not do."""
    return FamilyError(f"{source}: {arch} with {what} is not supported by plait ({why})")
