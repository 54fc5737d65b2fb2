"""A decoder-only transformer (Llama-style) written for one device.

The model is plain PyTorch with no distributed code: pre-norm blocks of RMSNorm,
grouped-query attention with rotary position embeddings through
:func:`torch.nn.functional.scaled_dot_product_attention`, and a SwiGLU feed-forward.
Parallel wrappers shard or wrap it from the outside.

Construction is cheap on the meta device (``with torch.device("meta"): Transformer(cfg)``
allocates nothing); :func:`materialize` later moves it to a real device and runs
:meth:`Transformer.init_weights`, which gives exactly the weights a direct build with
the same seed gives. Every parameter is drawn on the CPU from its own generator, seeded
from the run seed and the parameter's name, so the weights do not depend on the device,
on the order modules are materialised in, or on which other parameters exist.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig
from plait.config.model import layer_window
from plait.errors import ConfigError
from plait.model.blockwise_attention import blockwise_attention
from plait.model.document_mask import DocumentIds, visible
from plait.model.init import SEED_ATTR, param_seed
from plait.model.moe import MoE, is_moe_layer
from plait.model.moe_aux import link_model_aux
from plait.model.rotary_positions import rotary_rows

IGNORE_INDEX = -100
"""Target value that :func:`lm_loss` skips."""

_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned per-channel gain (no bias)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))  # (dim,)

    def reset_parameters(self) -> None:
        """Set the gain to ones."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x`` (any leading shape), in float32."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def scale_rope(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """``inv_freq`` ``(head_dim // 2,)`` float64 with ``cfg.rope_scaling`` applied, as
    Hugging Face's ``linear`` and ``llama3`` rope types compute it."""
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_scaling != "llama3":
        return inv_freq
    old, low, high = (
        cfg.rope_original_max_seq_len,
        cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor,
    )
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / cfg.rope_factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, cfg: ModelConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos/sin tables, each ``(max_seq_len, head_dim // 2)`` float32 on the CPU.

    Pair ``j`` of a head (channels ``j`` and ``j + head_dim/2``) rotates at frequency
    ``theta ** (-2j / head_dim)`` (scaled by ``cfg``'s ``rope_scaling``, if given,
    :func:`scale_rope`); the angles are computed in float64.
    """
    f64, cpu = torch.float64, torch.device("cpu")
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=f64, device=cpu) / head_dim)
    if cfg is not None:
        inv_freq = scale_rope(inv_freq, cfg)
    pos = torch.arange(max_seq_len, dtype=f64, device=cpu)
    angles = torch.outer(pos, inv_freq)  # (max_seq_len, head_dim // 2)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(batch, seq, heads, head_dim)`` by positions.

    ``cos`` and ``sin`` are ``(seq, head_dim // 2)``: row ``t`` holds the angles of the
    position of ``x[:, t]`` (or ``(batch, seq, head_dim // 2)``: positions per row).
    Channels ``j`` and ``j + head_dim/2`` form a rotated pair.
    """
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)  # (batch, seq, heads, head_dim // 2) each
    # (1 or batch, seq, 1, head_dim // 2); (batch, seq, half) tables: per-row positions
    c = (cos[:, :, None, :] if cos.dim() == 3 else cos[None, :, None, :]).float()
    s = (sin[:, :, None, :] if sin.dim() == 3 else sin[None, :, None, :]).float()
    out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return out.type_as(x)


class SDPAttention(nn.Module):
    """Causal grouped-query attention core through torch's fused
    :func:`~torch.nn.functional.scaled_dot_product_attention`:
    ``forward(q, k, v)`` with ``q`` ``(batch, heads, seq, head_dim)`` and ``k``/``v``
    ``(batch, kv_heads, seq, head_dim)`` -> ``(batch, heads, seq, head_dim)``.
    ``doc_ids`` ``(batch, seq)``: a boolean block-causal mask (same document, not later);
    ``window``: a sliding window (query ``i`` sees keys ``i - window < j <= i``)."""

    def __init__(self, window: int | None = None) -> None:
        super().__init__()
        self.window = window

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal attention of ``q`` over ``k``/``v`` (within documents when given)."""
        groups = q.shape[1] // k.shape[1]
        if doc_ids is not None or self.window is not None:
            return doc_sdpa(q, k, v, doc_ids, self.window)
        if groups == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if _SDPA_HAS_GQA:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        k = k.repeat_interleave(groups, dim=1)  # torch < 2.5: (batch, heads, seq, head_dim)
        v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def doc_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor | None,
    window: int | None = None,
) -> torch.Tensor:
    """SDPA with the block-causal mask of ``doc_ids`` ``(batch, seq)`` and the sliding
    ``window`` (``(batch or 1, 1, seq, seq)`` bool; every row sees at least itself, so
    no row is fully masked)."""
    pos = torch.arange(q.shape[2], device=q.device)
    mask = visible(doc_ids, doc_ids, pos, pos, window)  # (batch or 1, 1, seq, seq)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class BlockwiseAttention(nn.Module):
    """Causal attention core computed block by block with an online softmax
    (:func:`~plait.model.blockwise_attention.blockwise_attention`); same call as
    :class:`SDPAttention`."""

    def __init__(self, block_size: int = 128, window: int | None = None) -> None:
        super().__init__()
        self.block_size = block_size
        self.window = window

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal attention of ``q`` over ``k``/``v`` (within documents when given)."""
        out, _ = blockwise_attention(
            q, k, v, causal=True, block_size=self.block_size, doc_ids=doc_ids, window=self.window
        )
        return out


def attention_core(kind: str, window: int | None = None) -> nn.Module:
    """The one-device attention core named by ``model.attention`` (``window``: the
    layer's sliding window, :func:`~plait.config.model.layer_window`)."""
    if kind == "blockwise":
        return BlockwiseAttention(window=window)
    if kind == "sdpa":
        return SDPAttention(window)
    raise ConfigError(f"model.attention must be sdpa or blockwise, got {kind!r}.")


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions.

    The head counts used in :meth:`forward` are read from the projection shapes, so a
    wrapper may shard ``wq``/``wk``/``wv`` by output rows (whole heads) and ``wo`` by
    input columns without changing this code. ``core`` computes attention from the
    rotated heads (``model.attention``); context parallelism replaces it from outside
    with an attention that spans the cp ranks. ``doc_ids`` (document masking) are
    passed to the core only when given, so a core may take ``(q, k, v)`` alone.
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.core = attention_core(cfg.attention, layer_window(cfg, layer))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` ``(batch, seq, dim)``, tables ``(seq, head_dim // 2)`` -> ``(batch, seq, dim)``;
        ``doc_ids`` ``(batch, seq)`` (``(batch, cp·seq)`` under cp: the whole sequence's)."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)  # (batch, seq, heads, head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)  # (batch, seq, kv_heads, head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)  # (batch, seq, kv_heads, head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        q = q.transpose(1, 2)  # (batch, heads, seq, head_dim)
        k = k.transpose(1, 2)  # (batch, kv_heads, seq, head_dim)
        v = v.transpose(1, 2)  # (batch, kv_heads, seq, head_dim)
        # o: (batch, heads, seq, head_dim)
        o = self.core(q, k, v) if doc_ids is None else self.core(q, k, v, doc_ids)
        o = o.transpose(1, 2).reshape(b, s, -1)  # (batch, seq, heads * head_dim)
        return self.wo(o)


class TokenPositions(nn.Module):
    """The global positions of a rank's tokens: ``forward(seq)`` returns None, meaning
    ``0 .. seq-1`` (one device). Context parallelism replaces it from outside with the
    positions of the rank's sequence shard, so rotary angles stay global."""

    def forward(self, seq: int) -> torch.Tensor | None:
        """None: the tokens are positions ``0 .. seq-1``."""
        return None


def rope_for(
    cos: torch.Tensor, sin: torch.Tensor, positions: nn.Module, seq: int, max_seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows ``(seq, head_dim // 2)`` of the rotary tables for the local tokens."""
    pos = positions(seq)
    if pos is None:
        if seq > max_seq_len:
            raise ConfigError(f"sequence length {seq} exceeds model.max_seq_len ({max_seq_len}).")
        return cos[:seq], sin[:seq]
    if int(pos.max()) >= max_seq_len:
        raise ConfigError(
            f"global position {int(pos.max())} exceeds model.max_seq_len ({max_seq_len})."
        )
    pos = pos.to(cos.device)
    return cos[pos], sin[pos]


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, dim)`` -> ``(batch, seq, dim)``."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # hidden: (batch, seq, hidden)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module = (  # mixture of experts on the layers moe_every picks
            MoE(cfg) if is_moe_layer(cfg, layer) else FeedForward(cfg.dim, cfg.hidden_dim)
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(batch, seq, dim)`` -> ``(batch, seq, dim)``."""
        h = x + self.attention(self.attention_norm(x), cos, sin, doc_ids)
        return h + self.feed_forward(self.ffn_norm(h))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every target that is not :data:`IGNORE_INDEX`.

    ``logits`` ``(batch, seq, vocab)``, ``targets`` ``(batch, seq)``; computed in float32.
    """
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits.reshape(-1, vocab).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX
    )


class Transformer(nn.Module):
    """Decoder-only language model: embeddings, ``n_layers`` blocks, norm, output head.

    ``seed`` is passed to :meth:`init_weights` when the model is built on a real device;
    on the meta device nothing is initialised: the seed is kept (``plait_init_seed``;
    drawn from torch's global generator when None) for :meth:`initial_value`, which
    ``parallelize`` and :func:`materialize` use.
    """

    def __init__(self, cfg: ModelConfig, seed: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        link_model_aux(b.feed_forward for b in self.layers)  # moe_aux_loss_scope 'model'
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Filled by init_weights; not saved in checkpoints (recomputable from cfg).
        half = cfg.head_dim // 2
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, half), persistent=False)
        self.positions: nn.Module = TokenPositions()
        self.documents: nn.Module = DocumentIds()  # eos_id None: no document masking
        if not self.tok_embeddings.weight.is_meta:
            self.init_weights(seed)
        else:
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
            setattr(self, SEED_ATTR, seed)

    def tie_weights(self) -> None:
        """Make ``output.weight`` the embedding matrix again when the config ties them.

        ``Module.to_empty`` replaces each module's parameters separately and so unties
        them; :meth:`init_weights` calls this first.
        """
        if self.cfg.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Deterministically (re)initialise every parameter and the rotary tables.

        Linear and embedding weights ~ N(0, init_std²), with the residual output
        projections (``wo``, ``w2``) scaled by ``1/sqrt(2·n_layers)`` as in GPT-2; norm
        gains = 1. Each parameter is drawn on the CPU in float32 from a generator seeded
        by ``seed`` and its name, then copied to its device and dtype. ``seed=None`` draws
        the base seed from torch's global generator.
        """
        self.tie_weights()
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
        self.rope_cos.copy_(self.initial_value("rope_cos", seed))
        self.rope_sin.copy_(self.initial_value("rope_sin", seed))
        for name, param in self.named_parameters():
            param.copy_(self.initial_value(name, seed))

    def initial_value(self, name: str, seed: int, shape: torch.Size | None = None) -> torch.Tensor:
        """The initial value of the parameter or buffer ``name`` (one-device name), alone:
        a float32 CPU tensor of its one-device ``shape`` (default: the parameter's shape
        now) that depends only on ``seed`` and ``name`` (see :meth:`init_weights`); works
        on the meta device, where ``parallelize`` calls it for each tensor a rank keeps."""
        if name in ("rope_cos", "rope_sin"):
            cos, sin = rope_tables(
                self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, self.cfg
            )
            return cos if name == "rope_cos" else sin
        if shape is None:
            shape = self.get_parameter(name).shape
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.float32, device="cpu")
        std = self.cfg.init_std
        residual = ("attention.wo.weight", "feed_forward.w2.weight", "shared.w2.weight")
        if name.endswith((*residual, "experts.w2")):
            std = std / math.sqrt(2 * self.cfg.n_layers)
        gen = torch.Generator().manual_seed(param_seed(seed, name))
        value = torch.empty(shape, dtype=torch.float32, device="cpu")
        return value.normal_(0.0, std, generator=gen)

    def forward(
        self,
        tokens: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``.

        ``doc_ids`` ``(batch, seq)`` (default: ``self.documents(tokens)``, None unless
        document masking is on, :mod:`plait.model.document_mask`) restrict attention to
        tokens of the same document. ``position_ids`` ``(batch, seq)``: the rotary
        position of each token (default: the sequence's, or restarted at each document
        when ``self.documents.restart_positions``, :mod:`plait.model.rotary_positions`)."""
        seq = tokens.shape[1]
        docs = doc_ids if doc_ids is not None else self.documents(tokens)
        rows = rotary_rows(  # (batch, seq, head_dim // 2): per-row positions, or None
            self.rope_cos, self.rope_sin, self.positions, self.documents, seq, docs, position_ids
        )
        cos, sin = rows or rope_for(  # (seq, head_dim // 2)
            self.rope_cos, self.rope_sin, self.positions, seq, self.cfg.max_seq_len
        )
        h = self.tok_embeddings(tokens)  # (batch, seq, dim)
        for layer in self.layers:
            h = layer(h, cos, sin) if docs is None else layer(h, cos, sin, docs)
        h = self.norm(h)
        return self.output(h)  # (batch, seq, vocab)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """:func:`lm_loss`: mean cross-entropy, ``ignore_index=-100``."""
        return lm_loss(logits, targets)


def materialize(
    model: Transformer, device: torch.device | str, seed: int | None = None
) -> Transformer:
    """Allocate a meta-built ``model`` on ``device`` and initialise it with ``seed``.

    Gives the same weights as ``Transformer(cfg, seed=seed)`` built directly (``seed``
    None: the seed the meta build kept). This allocates the whole model; to allocate
    only a rank's pieces, pass the meta model to ``plait.parallelize`` instead.
    """
    if seed is None:
        seed = getattr(model, SEED_ATTR, None)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model
