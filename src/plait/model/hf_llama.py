"""transformers' own class of a family built from plait's size fields (``model.family =
"hf"``, old name ``"hf-llama"``): ``LlamaForCausalLM`` for a Llama (``model.arch``), the
family's class otherwise (Qwen2, Qwen3, Mistral, Phi-3, OLMo 2, from the family spec's
``config.json`` mapping), randomly initialised; nothing is downloaded.

Needs the optional extra ``plait[hf]`` (transformers). The fields map as:

====================  ================================
plait ModelConfig     transformers LlamaConfig
====================  ================================
vocab_size            vocab_size
dim                   hidden_size
n_layers              num_hidden_layers
n_heads               num_attention_heads
n_kv_heads            num_key_value_heads (default: n_heads)
ffn_dim               intermediate_size (default: plait's SwiGLU width)
max_seq_len           max_position_embeddings
rope_theta            rope_theta
rope_scaling, rope_*  rope_scaling (type, factor, ...)
norm_eps              rms_norm_eps
tie_embeddings        tie_word_embeddings
init_std              initializer_range
attention 'sdpa'      attn_implementation 'sdpa'
====================  ================================

The model is built with ``use_cache=False`` (training keeps no key/value cache) and
returns Hugging Face's output object; plait's loss reads its ``.logits``
(:func:`plait.model.factory.logits_of`). Its tensor-parallel plan is
:data:`plait.parallel.tensor.hf_llama_sharding_plan.HF_LLAMA_TP_PLAN`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.arch.families import family_named
from plait.config import ModelConfig
from plait.errors import ConfigError, install_hint


def import_transformers() -> Any:
    """The ``transformers`` module, or a :class:`ConfigError` saying how to install it."""
    try:
        import transformers
    except ImportError as e:
        raise ConfigError(
            "model.family 'hf' needs Hugging Face transformers, which is not "
            f"installed; install it with {install_hint('hf', 'transformers')}."
        ) from e
    return transformers


def llama_config(cfg: ModelConfig) -> Any:
    """The ``transformers`` config of ``cfg``'s family (``model.arch``): for a Llama a
    ``LlamaConfig`` (see the module docstring's table), for another family its own config
    class from the family spec's ``config.json`` mapping (:mod:`plait.arch.families`)."""
    if cfg.attention != "sdpa":
        raise ConfigError(
            f"model.attention {cfg.attention!r} is plait's own kernel; model.family "
            f"{cfg.family!r} uses transformers' attention: use model.attention 'sdpa'."
        )
    spec = family_named(cfg.arch)
    bad = spec.expresses(cfg)
    if bad is not None:
        raise ConfigError(
            f"model.family {cfg.family!r} builds transformers' {spec.architecture}, which has "
            f"no {bad}; use the built-in transformer (model.family 'plait')."
        )
    transformers = import_transformers()
    if cfg.arch != "llama":
        entries = {k: v for k, v in spec.to_config(cfg).items() if k != "architectures"}
        entries.update(use_cache=False)
        config = transformers.AutoConfig.for_model(**entries)
        # SDPA cannot soft-cap the scores (Gemma 2): transformers' eager attention does
        capped = cfg.attn_logit_softcap is not None
        config._attn_implementation = "eager" if capped else "sdpa"
        return config
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.hidden_dim,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling_entries(),
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        attention_bias=cfg.attention_bias == "qkvo",
        use_cache=False,
        attn_implementation="sdpa",
    )


def build_hf_llama(cfg: ModelConfig) -> nn.Module:
    """transformers' causal LM of ``cfg``'s family (``LlamaForCausalLM``,
    ``Qwen2ForCausalLM``, ...), initialised from torch's global generator (seed it first:
    every rank must build the same weights)."""
    transformers = import_transformers()
    model: nn.Module = transformers.AutoModelForCausalLM.from_config(llama_config(cfg))
    return model
