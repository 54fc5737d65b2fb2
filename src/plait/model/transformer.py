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
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig
from plait.errors import ConfigError
from plait.model.attention import (
    Attention,
    BlockwiseAttention,
    SDPAttention,
    attention_core,
    doc_sdpa,
)
from plait.model.document_mask import DocumentIds
from plait.model.init import SEED_ATTR, param_seed
from plait.model.moe import MoE, is_moe_layer
from plait.model.moe_aux import link_model_aux
from plait.model.norms import RMSNorm
from plait.model.rope import apply_rotary, model_rope_tables, rope_tables, rope_width, scale_rope
from plait.model.rotary_positions import rotary_rows

__all__ = [
    "IGNORE_INDEX",
    "Attention",
    "Block",
    "BlockwiseAttention",
    "FeedForward",
    "RMSNorm",
    "SDPAttention",
    "TokenPositions",
    "Transformer",
    "apply_rotary",
    "attention_core",
    "cap_logits",
    "doc_sdpa",
    "embed",
    "lm_loss",
    "materialize",
    "rope_for",
    "rope_tables",
    "scale_rope",
]

IGNORE_INDEX = -100
"""Target value that :func:`lm_loss` skips."""


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


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": _gelu_tanh,
}
"""``model.activation`` -> the gate's activation (GeGLU: transformers' gelu_pytorch_tanh)."""


class FeedForward(nn.Module):
    """Gated MLP: ``w2(act(w1 x) * w3 x)``, SwiGLU (``act`` 'silu') or GeGLU ('gelu_tanh')."""

    def __init__(self, dim: int, hidden_dim: int, activation: str = "silu") -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, dim)`` -> ``(batch, seq, dim)``."""
        return self.w2(self.act(self.w1(x)) * self.w3(x))  # hidden: (batch, seq, hidden)


class Block(nn.Module):
    """Transformer block. Pre-norm (``norm_placement`` 'pre', Llama): ``x + attn(norm(x))``
    then ``x + mlp(norm(x))``; post-norm ('post', OLMo 2): ``x + norm(attn(x))`` then
    ``x + norm(mlp(x))``, the same two norms (``attention_norm``, ``ffn_norm``);
    'sandwich' (Gemma 2/3): ``x + post_attention_norm(attn(attention_norm(x)))`` then
    ``x + post_ffn_norm(mlp(ffn_norm(x)))``, four norms."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        off = cfg.norm_unit_offset
        self.post_norm = cfg.norm_placement == "post"
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, off)
        self.attention = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, off)
        self.feed_forward: nn.Module = (  # mixture of experts on the layers moe_every picks
            MoE(cfg)
            if is_moe_layer(cfg, layer)
            else FeedForward(cfg.dim, cfg.hidden_dim, cfg.activation)
        )
        self.post_attention_norm: nn.Module | None = None
        self.post_ffn_norm: nn.Module | None = None
        if cfg.norm_placement == "sandwich":
            self.post_attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, off)
            self.post_ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, off)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(batch, seq, dim)`` -> ``(batch, seq, dim)``."""
        h = self.attend(x, lambda y: self.attention(y, cos, sin, doc_ids))
        return self.feed(h)

    def attend(
        self, x: torch.Tensor, attention: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The attention residual with ``attention`` (the block's, or a cached one)."""
        return self.residual(x, self.attention_norm, attention, self.post_attention_norm)

    def feed(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward residual."""
        return self.residual(x, self.ffn_norm, self.feed_forward, self.post_ffn_norm)

    def residual(
        self,
        x: torch.Tensor,
        norm: nn.Module,
        f: Callable[[torch.Tensor], torch.Tensor],
        after: nn.Module | None = None,
    ) -> torch.Tensor:
        """``x + f(norm(x))`` (pre-norm), ``x + norm(f(x))`` (post-norm) or
        ``x + after(f(norm(x)))`` (sandwich)."""
        if after is not None:
            return x + after(f(norm(x)))
        return x + norm(f(x)) if self.post_norm else x + f(norm(x))


def embed(embedding: nn.Module, tokens: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Token ids ``(batch, seq)`` -> ``(batch, seq, dim)`` through ``embedding``, times
    ``sqrt(dim)`` rounded to the embeddings' dtype with ``cfg.embedding_scale`` (Gemma)."""
    h = embedding(tokens)  # (batch, seq, dim)
    if cfg.embedding_scale:
        h = h * torch.tensor(cfg.dim**0.5, dtype=h.dtype)
    return h


def cap_logits(logits: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """``cap · tanh(logits / cap)`` with ``cfg.final_logit_softcap`` (else ``logits``);
    elementwise, so a vocabulary shard is capped alike."""
    cap = cfg.final_logit_softcap
    return logits if cap is None else torch.tanh(logits / cap) * cap


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
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_unit_offset)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Filled by init_weights; not saved in checkpoints (recomputable from cfg).
        half = rope_width(cfg)
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
        gains = 1, biases = 0. Each parameter is drawn on the CPU in float32 from a generator seeded
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
            cos, sin = model_rope_tables(self.cfg)
            return cos if name == "rope_cos" else sin
        if shape is None:
            shape = self.get_parameter(name).shape
        if name.endswith("norm.weight"):  # a gain of one: (1 + 0) with norm_unit_offset
            gain = 0.0 if self.cfg.norm_unit_offset else 1.0
            return torch.full(shape, gain, dtype=torch.float32, device="cpu")
        if name.endswith(".bias"):  # attention projection biases start at zero
            return torch.zeros(shape, dtype=torch.float32, device="cpu")
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
        h = embed(self.tok_embeddings, tokens, self.cfg)  # (batch, seq, dim)
        for layer in self.layers:
            h = layer(h, cos, sin) if docs is None else layer(h, cos, sin, docs)
        h = self.norm(h)
        return cap_logits(self.output(h), self.cfg)  # (batch, seq, vocab)

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
