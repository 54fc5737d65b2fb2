"""The shipped tensor-parallel plan of Hugging Face Llama-family causal LMs, as data.

``LlamaForCausalLM`` (and models with its module names: ``model.embed_tokens``,
``model.layers.N.self_attn.{q,k,v,o}_proj``, ``model.layers.N.mlp.{gate,up,down}_proj``,
the two RMSNorms per block, ``model.norm``, ``lm_head``) is cut as plait's own
transformer is (Shoeybi et al. 2019): per block one region for attention (Q by heads,
K/V by key/value heads, O row-parallel by heads) and one for the SwiGLU MLP (gate/up
column-parallel, down row-parallel), norms replicated, embedding and head
vocabulary-parallel. Hugging Face calls ``self_attn(hidden_states=...)`` by keyword; the
region hook takes its input from there. Its attention reshapes with ``-1`` heads and
reads ``num_key_value_groups`` (older versions also ``num_heads``,
``num_key_value_heads`` and ``hidden_size``): :func:`plait.parallel.tensor.sharding_plan.
apply_tensor_parallel` sets those to the per-rank counts on each attention module.

Sequence parallelism is refused for these models: their forward builds positions and
the causal mask from the length of the (then sharded) hidden states.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from plait.parallel.tensor.sharding_plan import Style

HF_LLAMA_TP_PLAN: tuple[tuple[str, Style], ...] = (
    ("model.embed_tokens", "vocab_embedding"),
    ("model.layers.*.input_layernorm", "replicate"),
    ("model.layers.*.self_attn", "region"),
    ("model.layers.*.self_attn.q_proj", "colwise_heads"),
    ("model.layers.*.self_attn.k_proj", "colwise_kv_heads"),
    ("model.layers.*.self_attn.v_proj", "colwise_kv_heads"),
    ("model.layers.*.self_attn.o_proj", "rowwise_heads"),
    ("model.layers.*.post_attention_layernorm", "replicate"),
    ("model.layers.*.mlp", "region"),
    ("model.layers.*.mlp.gate_proj", "colwise"),
    ("model.layers.*.mlp.up_proj", "colwise"),
    ("model.layers.*.mlp.down_proj", "rowwise"),
    ("model.norm", "replicate"),
    ("lm_head", "vocab_head"),
)
"""Tensor-parallel plan of ``transformers.LlamaForCausalLM`` (module patterns, styles)."""

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
"""``config.model_type`` values given :data:`HF_LLAMA_TP_PLAN` by default: Llama's module
names (Qwen2's biases split with their projections; Qwen3 adds its per-head q/k norms,
:func:`hf_tp_plan`). Phi-3 (fused q/k/v) and OLMo 2 (q/k norms over the whole
projection) are refused under tp (:mod:`plait.parallel.checks`)."""

HF_QK_NORM_ROWS: tuple[tuple[str, Style], ...] = (
    ("model.layers.*.self_attn.q_norm", "replicate_summed"),
    ("model.layers.*.self_attn.k_norm", "replicate_summed"),
)
"""Qwen3's per-head q/k norms: whole on every rank, gradients summed over tp."""


def hf_tp_plan(model: nn.Module) -> tuple[tuple[str, Style], ...]:
    """The plan of a Hugging Face model :func:`is_hf_llama` accepts: :data:`HF_LLAMA_TP_PLAN`
    plus :data:`HF_QK_NORM_ROWS` for Qwen3."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return HF_LLAMA_TP_PLAN + HF_QK_NORM_ROWS if kind == "qwen3" else HF_LLAMA_TP_PLAN


def is_hf_llama(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face Llama-family causal LM (by its config's
    ``model_type`` and the presence of ``model.layers`` and ``lm_head``)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    inner = getattr(model, "model", None)
    return (
        kind in LLAMA_FAMILY
        and isinstance(getattr(model, "lm_head", None), nn.Linear)
        and isinstance(getattr(inner, "layers", None), nn.ModuleList)
    )
