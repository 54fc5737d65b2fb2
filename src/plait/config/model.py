"""The model section (``[model]``): size and shape of the transformer, or your own model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plait.config.choices import (
    Activation,
    Architecture,
    AttentionBias,
    AttentionKind,
    ModelFamily,
    MoEAuxScope,
    MoERouter,
    NormPlacement,
    QKNorm,
    RopeScaling,
    check_choices,
)
from plait.config.rules.choices import check_positive
from plait.config.rules.model import (
    check_attention_window,
    check_moe,
    check_rope_scaling,
    check_softcap,
)
from plait.errors import ConfigError


@dataclass
class ModelConfig:
    """The model: size and shape of the built-in decoder-only transformer (the same sizes
    build a Hugging Face Llama with family 'hf-llama'), or your own model (factory)."""

    vocab_size: int = 256
    """Vocabulary size; 256 for the built-in byte-level tokenizer."""
    dim: int = 128
    """Hidden (model) width h."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Number of query heads; dim must be divisible by it."""
    n_kv_heads: int | None = None
    """Number of key/value heads for grouped-query attention (default: n_heads)."""
    ffn_dim: int | None = None
    """Hidden width of the SwiGLU MLP (default: 8/3·dim rounded up to multiple_of)."""
    multiple_of: int = 32
    """The default ffn_dim is rounded up to a multiple of this."""
    max_seq_len: int = 256
    """Longest sequence the rotary tables are built for."""
    rope_theta: float = 10000.0
    """Base of the rotary position frequencies."""
    rope_scaling: RopeScaling = "none"
    """Rotary frequency scaling, as Hugging Face's rope_scaling: 'none', 'linear' (every
    frequency divided by rope_factor) or 'llama3' (Llama 3.1's: wavelengths above
    rope_original_max_seq_len / rope_low_freq_factor divided by rope_factor, below
    rope_original_max_seq_len / rope_high_freq_factor kept, smoothed between). Set from
    config.json by --init-from a Hugging Face folder."""
    rope_factor: float = 1.0
    """The rope_scaling factor."""
    rope_low_freq_factor: float = 1.0
    """'llama3' scaling's low_freq_factor."""
    rope_high_freq_factor: float = 4.0
    """'llama3' scaling's high_freq_factor."""
    rope_original_max_seq_len: int = 8192
    """'llama3' scaling's original_max_position_embeddings (the pretraining length)."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm."""
    head_width: int | None = None
    """Width of one attention head (default: dim / n_heads); Qwen3 and Gemma set another
    (the q/k/v projections are n_heads·head_width and kv_heads·head_width wide)."""
    attention_bias: AttentionBias = "none"
    """Biases of the attention projections: 'none' (Llama), 'qkv' (Qwen2: q, k and v) or
    'qkvo' (all four; Llama's attention_bias = true). Under tensor parallelism a
    column-parallel bias is split with its rows, the row-parallel one added once."""
    qk_norm: QKNorm = "none"
    """RMSNorm of queries and keys before RoPE: 'none', 'head' (one gain of head_width per
    head, shared by the heads; Qwen3) or 'projection' (over the whole q and k projections,
    one gain per channel; OLMo 2: under tensor parallelism its sums of squares are
    all-reduced over tp)."""
    norm_placement: NormPlacement = "pre"
    """'pre': x + f(norm(x)) (Llama); 'post': x + norm(f(x)) (OLMo 2); 'sandwich':
    x + norm2(f(norm1(x))) (Gemma 2/3: input, post-attention, pre- and post-feed-forward
    norms)."""
    norm_unit_offset: bool = False
    """Every RMSNorm (q/k norms included) scales by (1 + w) instead of w, its weight stored
    as Hugging Face stores it (zeros at init; Gemma), computed in float32."""
    embedding_scale: bool = False
    """Multiply the token embeddings by sqrt(dim), rounded to the embeddings' dtype as
    transformers does (Gemma)."""
    activation: Activation = "silu"
    """The gated MLP's activation: 'silu' (SwiGLU) or 'gelu_tanh' (GeGLU with
    gelu_pytorch_tanh, Gemma)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by query_pre_attn_scalar ** -0.5 (None: 1/sqrt(head
    dim); Gemma 2/3). Refused under context parallelism unless it equals the head width
    (the ring and Ulysses kernels scale by 1/sqrt(head dim))."""
    attn_logit_softcap: float | None = None
    """Soft-capping of the attention scores, cap · tanh(s / cap) before the mask (Gemma 2):
    computed with explicit scores under 'sdpa'; refused with 'blockwise' and under
    context parallelism (their kernels do not cap)."""
    final_logit_softcap: float | None = None
    """Soft-capping of the output logits, cap · tanh(z / cap) (Gemma 2/3); elementwise, so
    it applies to a vocabulary shard under tensor parallelism alike."""
    rope_local_theta: float | None = None
    """RoPE base of the sliding-window layers, unscaled (Gemma 3's rope_local_base_freq);
    the full-attention layers keep rope_theta and rope_scaling. None: one RoPE for all."""
    arch: Architecture = "llama"
    """The Hugging Face family whose names and config.json the weights are read and
    exported with (``plait models`` lists them: llama, mistral, qwen2, qwen3, phi3,
    olmo2, mixtral, qwen2-moe, qwen3-moe); set from config.json by --init-from a Hugging
    Face folder."""
    sliding_window: int | None = None
    """Sliding-window attention (Hugging Face's semantics): the query at position i sees
    the keys j with i - sliding_window < j <= i (None: every layer attends to the whole
    causal prefix). Positions are the sequence's (global under context parallelism)."""
    layer_types: tuple[str, ...] | None = None
    """Per layer, 'full_attention' or 'sliding_attention' (Hugging Face's vocabulary, one
    entry per layer); None: every layer slides when sliding_window is set."""
    tie_embeddings: bool = False
    """Share the token-embedding matrix with the output head."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    attention: AttentionKind = "sdpa"
    """Attention kernel on one device: 'sdpa' (torch's fused scaled_dot_product_attention)
    or 'blockwise' (plait's exact block-by-block online-softmax attention, which saves
    only O(seq) per head for backward). Under parallel.cp > 1 the cp attention is used."""
    family: ModelFamily = "plait"
    """Which model the size fields build: 'plait' (the built-in transformer) or 'hf'
    (Hugging Face transformers' own class of model.arch, e.g. LlamaForCausalLM or
    Qwen2ForCausalLM, from its config with these sizes, randomly initialised, nothing
    downloaded; needs the extra plait[hf]); 'hf-llama' is the old name of 'hf'.
    docs/models.md maps the fields."""
    factory: str | None = None
    """Your own model: 'package.module:function', called as function(model_config) after
    torch.manual_seed(train.seed); it returns an nn.Module mapping token ids (batch, seq)
    to logits (batch, seq, vocab) or to an output with .logits. The module must be
    importable (installed, on PYTHONPATH or in the current folder). Overrides family."""
    moe_experts: int = 0
    """Routed experts per mixture-of-experts layer (E); 0: every feed-forward is dense
    (docs/moe.md)."""
    moe_top_k: int = 2
    """Experts each token is routed to (k <= moe_experts)."""
    moe_every: int = 1
    """Layer i uses the MoE feed-forward when (i + 1) % moe_every == 0 (1: every layer,
    2: every second layer, ...); the others stay dense."""
    moe_shared_experts: int = 0
    """Always-on experts (DeepSeek style), computed for every token beside the routed ones
    (one SwiGLU of width moe_shared_experts * moe_hidden_dim)."""
    moe_hidden_dim: int | None = None
    """Hidden width of one expert's SwiGLU (default: the dense hidden width / top-k, so a
    token's active feed-forward FLOPs match the dense model's)."""
    moe_router: MoERouter = "softmax"
    """Router: 'softmax' (softmax over all experts, then the top-k) or 'sigmoid' (sigmoid
    scores, then the top-k; DeepSeek-V3). moe_norm_topk_prob says whether the k weights
    are then renormalised."""
    moe_norm_topk_prob: bool = True
    """Renormalise each token's top-k router weights to sum 1 (Mixtral always does;
    Qwen2/Qwen3-MoE's norm_topk_prob). False: the experts' outputs are weighted by the raw
    top-k scores (softmax probabilities; with k = 1 the Switch Transformer's router)."""
    moe_shared_expert_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(x . w_gate), a (1, dim) gate
    (Qwen2-MoE's shared_expert_gate); needs moe_shared_experts > 0."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss in the training loss (0: off); its form is
    moe_aux_loss_scope's."""
    moe_aux_loss_scope: MoEAuxScope = "layer"
    """'layer': each MoE layer adds the Switch/GShard loss E * sum_i f_i * P_i (f_i the
    fraction of its assignments routed to expert i, P_i its mean router probability).
    'model': one loss for the whole model, transformers' load_balancing_loss_func
    (Mixtral, Qwen-MoE): E * sum_i F_i * P_i with F_i the assignments to i per token and
    P_i the mean probability of i, both over the tokens of every MoE layer together (F
    sums to top-k). 'model' needs parallel.pp = 1 (the layers' counts meet in backward)."""
    moe_z_loss_coef: float = 0.001
    """Weight of the router z-loss mean(logsumexp(logits)^2) in the training loss (0: off)."""
    moe_capacity_factor: float = 0.0
    """0: dropless (every routed token is computed). > 0: each expert takes at most
    ceil(factor * tokens * k / E) of a rank's routed tokens per layer; the overflow is
    dropped (top-1 choices first, then by token index) and counted."""

    def __post_init__(self) -> None:
        if isinstance(self.layer_types, list):  # from JSON or TOML
            self.layer_types = tuple(self.layer_types)
        check_choices(self, "model.")
        check_positive(
            "model.",
            vocab_size=self.vocab_size,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn_dim=self.ffn_dim,
            multiple_of=self.multiple_of,
            max_seq_len=self.max_seq_len,
            rope_theta=self.rope_theta,
            rope_factor=self.rope_factor,
            rope_low_freq_factor=self.rope_low_freq_factor,
            rope_high_freq_factor=self.rope_high_freq_factor,
            rope_original_max_seq_len=self.rope_original_max_seq_len,
            norm_eps=self.norm_eps,
            init_std=self.init_std,
            head_width=self.head_width,
            query_pre_attn_scalar=self.query_pre_attn_scalar,
            attn_logit_softcap=self.attn_logit_softcap,
            final_logit_softcap=self.final_logit_softcap,
            rope_local_theta=self.rope_local_theta,
        )
        check_softcap(self.attn_logit_softcap, self.attention)
        check_rope_scaling(self.rope_scaling, self.rope_low_freq_factor, self.rope_high_freq_factor)
        if self.head_width is None and self.dim % self.n_heads:
            raise ConfigError(
                f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads}) "
                "(or set model.head_width)."
            )
        if self.head_dim % 2:
            what = "dim/n_heads" if self.head_width is None else "model.head_width"
            raise ConfigError(
                f"the head dimension {what} = {self.head_dim} must be even for rotary positions."
            )
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads "
                f"({self.kv_heads}) for grouped-query attention."
            )
        if self.factory is not None:
            module, sep, attr = self.factory.partition(":")
            if not (sep and module.strip() and attr.strip()):
                raise ConfigError(
                    f"model.factory must be 'package.module:function', got {self.factory!r}."
                )
        check_moe(
            self.moe_experts,
            self.moe_top_k,
            self.moe_every,
            self.moe_shared_experts,
            self.moe_hidden_dim,
            self.moe_aux_loss_coef,
            self.moe_z_loss_coef,
            self.moe_capacity_factor,
            self.moe_shared_expert_gate,
        )
        check_attention_window(self.sliding_window, self.layer_types, self.n_layers)

    @property
    def kv_heads(self) -> int:
        """Key/value head count with the default applied."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head (head_width, default dim / n_heads)."""
        return self.head_width if self.head_width is not None else self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden width with the default applied."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        raw = (8 * self.dim) // 3
        return self.multiple_of * ((raw + self.multiple_of - 1) // self.multiple_of)

    def rope_scaling_entries(self) -> dict[str, Any] | None:
        """The RoPE scaling as Hugging Face's config writes it (``rope_type``, ``factor``
        and llama3's frequency factors); None: unscaled."""
        if self.rope_scaling == "none":
            return None
        out: dict[str, Any] = {"rope_type": self.rope_scaling, "factor": self.rope_factor}
        if self.rope_scaling == "llama3":
            out["low_freq_factor"] = self.rope_low_freq_factor
            out["high_freq_factor"] = self.rope_high_freq_factor
            out["original_max_position_embeddings"] = self.rope_original_max_seq_len
        return out


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether block ``layer`` (0-based) uses the MoE feed-forward."""
    return cfg.moe_experts > 0 and (layer + 1) % cfg.moe_every == 0


def layer_window(cfg: ModelConfig, layer: int) -> int | None:
    """The attention window of block ``layer`` (0-based): ``cfg.sliding_window`` on a
    'sliding_attention' layer (every layer when ``layer_types`` is None), else None."""
    if cfg.sliding_window is None:
        return None
    if cfg.layer_types is None or cfg.layer_types[layer] == "sliding_attention":
        return cfg.sliding_window
    return None


def expert_hidden_dim(cfg: ModelConfig) -> int:
    """One expert's hidden width (default: the dense width divided by top-k)."""
    if cfg.moe_hidden_dim is not None:
        return cfg.moe_hidden_dim
    return max(1, cfg.hidden_dim // cfg.moe_top_k)
