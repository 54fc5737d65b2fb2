"""Activation memory: the tensors autograd saves per block, per micro-batch.

The model lists every tensor one transformer block saves for backward, with its size
per token, its element type and whether tensor parallelism shards it. Summing the list
for Megatron-LM's GPT block in 16-bit with dropout and unfused attention reproduces
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", eq. 1-6) exactly::

    per layer, no parallelism:      s·b·h·(34 + 5·a·s/h)          bytes
    tensor parallel t:              s·b·h·(10 + 24/t + 5·a·s/(h·t))
    + sequence parallel:            s·b·h·(34 + 5·a·s/h) / t
    + selective recomputation:      s·b·h·34 / t
    full recomputation:             2·s·b·h (block input only; / t with SP)

plus, in this model, the norms' fp32 statistics that the paper leaves out (8 bytes per
token per LayerNorm). The same list for plait's block (RMSNorm written in PyTorch, RoPE,
SwiGLU, fused attention, no dropout, fp32 on CPU) gives, per token and layer::

    x, y, x·g of each RMSNorm (3h each)     rstd (1 fp32 each)
    q (a·d), k, v (kv·d each)               attention output a·d, log-sum-exp a (fp32)
    gate, silu(gate), up, silu·up (4f)

i.e. ``(8h + 2·kv·d + 4f)·e + (2 + a)·4`` bytes per token with element size e (4 in
fp32): the derivation behind the "fp32, no dropout" row of the validation table. The
rotary tables are buffers, not activations; the reshape of the attention output before
the output projection is a view of the kernel's output, so it is saved once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from plait.plan.layout import Layout, Precision, Runtime
from plait.plan.modelspec import ModelSpec
from plait.plan.query import Query

Kind = Literal["act", "fp32", "mask", "index"]
Region = Literal["norm", "gathered", "tp", "kv", "full"]


@dataclass(frozen=True)
class Saved:
    """One tensor saved for backward, per token of a micro-batch."""

    name: str
    """What it is, e.g. ``attn.q``."""
    per_token: float
    """Elements per token (before any split)."""
    per_token_seq: float = 0.0
    """Elements per token per key position (the s x s attention terms; times s)."""
    kind: Kind = "act"
    """Element type: the activation dtype, fp32 statistics, 1-byte masks, int64 indices."""
    region: Region = "tp"
    """``tp``: sharded by tensor parallelism; ``kv``: sharded by key/value heads (whole
    heads, replicated when tp exceeds them); ``norm``: replicated across the tensor-
    parallel group unless sequence parallelism shards it; ``gathered``: the input of a
    column-parallel layer, all-gathered from sequence shards under sequence parallelism
    and kept whole unless the runtime re-gathers it in backward; ``full``: never split."""
    core: bool = False
    """Part of core attention (what selective recomputation recomputes)."""

    def element_bytes(self, precision: Precision) -> int:
        """Bytes of one element."""
        return {"act": precision.activation_bytes, "fp32": 4, "mask": 1, "index": 8}[self.kind]


def kv_heads_local(spec: ModelSpec, tp: int) -> int:
    """Key/value heads on one tensor-parallel rank (replicated when tp > kv heads)."""
    return max(1, spec.n_kv_heads // tp)


def _norm(prefix: str, spec: ModelSpec, runtime: Runtime, consumer: str) -> list[Saved]:
    h = spec.hidden
    stats = 1.0 if spec.style == "llama" else 2.0
    out = [
        Saved(f"{prefix}.input", h, region="norm"),
        Saved(f"{prefix}.stats", stats, kind="fp32", region="norm"),
    ]
    if spec.style == "llama" and not runtime.fused_norm:
        out.append(Saved(f"{prefix}.normalized", h, region="norm"))
    out.append(Saved(f"{consumer}.input", h, region="gathered"))
    return out


def block_saved(spec: ModelSpec, runtime: Runtime) -> list[Saved]:
    """Everything one block saves (no recomputation, no parallelism applied)."""
    h, f, a = spec.hidden, spec.ffn_hidden, spec.n_heads
    out = _norm("attn_norm", spec, runtime, "qkv")
    out += [
        Saved("attn.q", spec.q_width),
        Saved("attn.k", spec.kv_width, region="kv"),
        Saved("attn.v", spec.kv_width, region="kv"),
    ]
    if runtime.attention == "flash":
        out += [
            Saved("attn.out", spec.q_width),  # also the output projection's input (a view)
            Saved("attn.lse", a, kind="fp32", core=True),
        ]
    else:
        out.append(Saved("attn.softmax", 0.0, a, core=True))
        if runtime.dropout:
            out.append(Saved("attn.dropout_mask", 0.0, a, kind="mask", core=True))
            out.append(Saved("attn.dropout_out", 0.0, a, core=True))
        out.append(Saved("attn.proj_input", spec.q_width))
    if runtime.dropout:
        out.append(Saved("attn.resid_dropout_mask", h, kind="mask", region="norm"))
    out += _norm("mlp_norm", spec, runtime, "mlp")
    if spec.style == "llama":
        out += [Saved("mlp.gate", f), Saved("mlp.up", f), Saved("mlp.down_input", f)]
        if not runtime.fused_swiglu:
            out.append(Saved("mlp.silu", f))
    else:
        out += [Saved("mlp.gelu_input", f), Saved("mlp.fc2_input", f)]
    if runtime.dropout:
        out.append(Saved("mlp.dropout_mask", h, kind="mask", region="norm"))
    return out


def kept_saved(spec: ModelSpec, runtime: Runtime, recompute: str) -> list[Saved]:
    """What a block keeps between its forward and backward under ``recompute``."""
    if recompute == "full":
        return [Saved("block.input", spec.hidden, region="norm")]
    saved = block_saved(spec, runtime)
    if recompute == "selective":
        saved = [s for s in saved if not s.core]
    return saved


def _bytes(
    items: list[Saved],
    spec: ModelSpec,
    precision: Precision,
    runtime: Runtime,
    seq_len: int,
    split: tuple[int, int, int, bool],
) -> float:
    """Bytes of ``items`` for one micro-batch on one rank; ``split`` is (tp, cp,
    micro-batch, sequence parallel)."""
    t, c, mb, sp = split
    tokens = mb * seq_len / c  # tokens of the local sequence shard
    kv_scale = kv_heads_local(spec, t) / spec.n_kv_heads
    resharded = not runtime.sp_saves_gathered  # the runtime re-gathers in backward
    total = 0.0
    for s in items:
        per_tok = s.per_token + s.per_token_seq * seq_len  # local queries x all keys
        if s.region == "tp":
            per_tok /= t
        elif s.region == "kv":
            per_tok *= kv_scale
        elif sp and (s.region == "norm" or (s.region == "gathered" and resharded)):
            per_tok /= t
        total += tokens * per_tok * s.element_bytes(precision)
    return total


def _split(layout: Layout) -> tuple[int, int, int, bool]:
    return layout.tp, layout.cp, layout.micro_batch, layout.sequence_parallel


@functools.lru_cache(maxsize=4096)
def _part_bytes(
    part: str,
    spec: ModelSpec,
    precision: Precision,
    runtime: Runtime,
    seq_len: int,
    split: tuple[int, int, int, bool],
    recompute: str,
) -> float:
    if part == "layer":
        items = kept_saved(spec, runtime, recompute)
    elif part == "embedding":
        items = embedding_saved(spec, runtime, split[0])
    else:
        items = head_saved(spec, runtime, split[0])
    return _bytes(items, spec, precision, runtime, seq_len, split)


def layer_activation_bytes(q: Query, layout: Layout) -> float:
    """Bytes one block keeps for backward for one micro-batch on one rank."""
    return _part_bytes(
        "layer", q.model, q.precision, q.runtime, q.seq_len, _split(layout), layout.recompute
    )


def embedding_saved(spec: ModelSpec, runtime: Runtime, tp: int = 1) -> list[Saved]:
    """What the input embedding saves (first pipeline stage); vocabulary-parallel
    (tp > 1), also the mask of the tokens outside this rank's vocabulary range."""
    out = [Saved("embed.indices", 1.0, kind="index", region="full")]
    if tp > 1:
        out.append(Saved("embed.vocab_mask", 1.0, kind="mask", region="full"))
    if runtime.dropout:
        out.append(Saved("embed.dropout_mask", spec.hidden, kind="mask", region="norm"))
    return out


def head_saved(spec: ModelSpec, runtime: Runtime, tp: int = 1) -> list[Saved]:
    """What the final norm, output head and cross-entropy save (last stage).

    The default loss is the chunked cross-entropy (:mod:`plait.parallel.chunked_loss`,
    ``train.loss_chunk`` > 0, and always when tp > 1): it keeps this rank's V/t logits
    as they are (the activation dtype; the softmax is recomputed in backward), each
    token's fp32 log-sum-exp, the int64 targets and two 1-byte masks per token (targets
    kept, and in this rank's range) and no loss scalar. (``train.loss_chunk = 0`` at
    tp = 1 is ``F.cross_entropy``, which keeps fp32 log-probabilities instead: 4 bytes
    per vocabulary entry whatever the dtype; not modelled here.)
    """
    out = _norm("final_norm", spec, runtime, "head")
    out.append(Saved("loss.logits", spec.vocab, kind="act"))
    out.append(Saved("loss.lse", 1.0, kind="fp32", region="full"))
    out.append(Saved("loss.targets", 1.0, kind="index", region="full"))
    out.append(Saved("loss.target_masks", 2.0, kind="mask", region="full"))
    return out


def embedding_activation_bytes(q: Query, layout: Layout) -> float:
    """Bytes the embedding keeps for one micro-batch."""
    return _part_bytes("embedding", q.model, q.precision, q.runtime, q.seq_len, _split(layout), "")


def head_activation_bytes(q: Query, layout: Layout) -> float:
    """Bytes the final norm, head and loss keep for one micro-batch."""
    return _part_bytes("head", q.model, q.precision, q.runtime, q.seq_len, _split(layout), "")


def korthikanti_layer_bytes(
    s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none"
) -> float:
    """Korthikanti et al. 2022, per layer, 16-bit, with dropout (table 2 of the paper)."""
    if recompute == "full":
        return 2.0 * s * b * h / (t if sp else 1)
    attn = 0.0 if recompute == "selective" else 5.0 * a * s / h
    if sp:
        return s * b * h * (34.0 + attn) / t
    return s * b * h * (10.0 + 24.0 / t + attn / t)
