"""Parameter and FLOP arithmetic of a decoder-only transformer, written once.

The built-in model (:mod:`plait.model`) and the planner (:mod:`plait.plan`) both count
with these functions: the per-block terms (:func:`attention_params`,
:func:`mlp_params`, :func:`moe_ffn_params`), the training-FLOPs rule
(:func:`training_flops_per_token`, :func:`attention_flops_per_token`) and, on a
:class:`~plait.config.ModelConfig`, the whole model's :func:`param_count`,
:func:`active_param_count` and :func:`flops_per_token`; Muon's Newton-Schulz FLOPs of a
matrix (:func:`newton_schulz_flops`, used by the optimizer and the planner). Plain
integers, no torch.

FLOPs follow Chowdhery et al. 2022 (PaLM), appendix B: ``6·N + 12·L·s·a·d`` per token,
forward and backward, where N counts the weights of every matmul (the blocks' linear
layers and the output head, tied or not; not the embedding lookup, norms or biases) and
the attention term counts ``QKᵀ`` and ``AV`` without discounting the causal mask, so MFU
figures are comparable with PaLM's. Of an MoE layer N counts the active weights
(router, shared and ``top_k`` routed experts), so MFU counts active parameters.
"""

from __future__ import annotations

from plait.config import ModelConfig
from plait.config.model import expert_hidden_dim, is_moe_layer

SWIGLU_MATS = 3
"""Weight matrices of a SwiGLU feed-forward (gate, up, down); a GELU MLP has 2."""


def attention_params(hidden: int, q_width: int, kv_width: int) -> int:
    """Weights of one attention layer: the query and output projections (``h x a·d``
    each) and the key and value projections (``h x kv·d`` each); no biases."""
    return 2 * hidden * q_width + 2 * hidden * kv_width


def mlp_params(hidden: int, ffn_hidden: int, mats: int = SWIGLU_MATS) -> int:
    """Weights of one dense feed-forward of width ``ffn_hidden`` with ``mats`` matrices."""
    return mats * hidden * ffn_hidden


def moe_ffn_params(
    hidden: int, experts: int, expert_hidden: int, shared: int, routed: int, gate: bool = False
) -> int:
    """Weights of one MoE feed-forward: the router ``(E, h)``, ``shared`` always-on
    experts and ``routed`` of the ``experts`` routed ones (all ``E``, or ``top_k`` for
    the weights one token uses), each a SwiGLU of width ``expert_hidden``; with ``gate``
    the shared experts' ``(1, h)`` gate (Qwen2-MoE's)."""
    routers = hidden * (experts + int(gate))
    return routers + (routed + shared) * mlp_params(hidden, expert_hidden)


def attention_flops_per_token(n_layers: int, seq_len: int, attention_width: int) -> float:
    """The attention part of the training FLOPs per token: ``12·L·s·a·d``."""
    return float(12 * n_layers * seq_len * attention_width)


def training_flops_per_token(
    matmul_params: int, n_layers: int, seq_len: int, attention_width: int
) -> float:
    """Training FLOPs (forward + backward) per token: ``6·N`` for the ``matmul_params``
    weights N plus :func:`attention_flops_per_token`."""
    return 6 * matmul_params + attention_flops_per_token(n_layers, seq_len, attention_width)


def newton_schulz_flops(shape: tuple[int, int], steps: int) -> int:
    """FLOPs (2 per multiply-add) of ``steps`` quintic Newton-Schulz iterations (Muon's
    orthogonalisation) on an ``(A, B)`` matrix, ``m = min(A, B)``, ``n = max(A, B)``: per
    step ``x xᵀ`` (2 m² n), the polynomial's ``gram @ gram`` (2 m³) and ``poly @ x``
    (2 m² n)."""
    m, n = min(shape), max(shape)
    return steps * (4 * m * m * n + 2 * m**3)


def block_matmul_params(cfg: ModelConfig, layer: int = 0, active: bool = True) -> int:
    """Weights of the linear layers of block ``layer`` of ``Transformer(cfg)``: of an MoE
    block, the router, the shared experts and ``top_k`` routed experts (``active``) or
    all of them."""
    attn = attention_params(cfg.dim, cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim)
    if not is_moe_layer(cfg, layer):
        return attn + mlp_params(cfg.dim, cfg.hidden_dim)
    routed = cfg.moe_top_k if active else cfg.moe_experts
    return attn + moe_ffn_params(
        cfg.dim,
        cfg.moe_experts,
        expert_hidden_dim(cfg),
        cfg.moe_shared_experts,
        routed,
        cfg.moe_shared_expert_gate,
    )


def block_vector_params(cfg: ModelConfig) -> int:
    """The vectors of one block beside its two norm gains: the projection biases
    (``attention_bias``), the query/key norm gains (``qk_norm``) and the post-sublayer
    norm gains of a 'sandwich' block (Gemma)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    biases = {"none": 0, "qkv": q + 2 * kv, "qkvo": q + 2 * kv + cfg.dim}[cfg.attention_bias]
    norms = {"none": 0, "head": 2 * cfg.head_dim, "projection": q + kv}[cfg.qk_norm]
    post = 2 * cfg.dim if cfg.norm_placement == "sandwich" else 0
    return biases + norms + post


def param_count(cfg: ModelConfig, include_embeddings: bool = True, active: bool = False) -> int:
    """Number of parameters of ``Transformer(cfg)``, computed from the config.

    With ``include_embeddings=False`` the vocabulary-sized matrices (token embedding and,
    when untied, the output head) are left out, as in the "non-embedding N" of scaling
    laws; the norms stay in. ``active=True`` counts, of each MoE layer, only the
    parameters one token uses (router, shared experts and ``top_k`` routed experts).
    """
    layers = sum(block_matmul_params(cfg, i, active) for i in range(cfg.n_layers))
    body = layers + cfg.n_layers * (2 * cfg.dim + block_vector_params(cfg)) + cfg.dim
    if not include_embeddings:
        return body
    vocab = cfg.vocab_size * cfg.dim
    return body + vocab + (0 if cfg.tie_embeddings else vocab)


def active_param_count(cfg: ModelConfig, include_embeddings: bool = True) -> int:
    """Parameters one token uses (:func:`param_count` with ``active=True``; the whole
    model for a dense one)."""
    return param_count(cfg, include_embeddings, active=True)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token of ``Transformer(cfg)`` at sequence
    length ``seq_len``: :func:`training_flops_per_token` over the active matmul weights
    of every block plus the output head (whether or not it is tied)."""
    layers = sum(block_matmul_params(cfg, i) for i in range(cfg.n_layers))
    n_matmul = layers + cfg.vocab_size * cfg.dim
    return training_flops_per_token(n_matmul, cfg.n_layers, seq_len, cfg.n_heads * cfg.head_dim)
