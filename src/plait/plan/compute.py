"""Compute time of one micro-batch on one rank: GEMMs, attention, memory-bound work.

FLOPs follow the usual accounting (Kaplan et al. 2020; Narayanan et al. 2021, eq. 3;
Chowdhery et al. 2022 appendix B): a GEMM of (M x K)·(K x N) costs 2·M·K·N in forward
and twice that in backward (input and weight gradients), so a model costs
``6·N·tokens + 12·L·s·a·d·tokens`` per step; full recomputation repeats the forward
(x 4/3), selective recomputation repeats only core attention (Korthikanti et al. 2022).

Time is a roofline sum over the block's operations, each at the rate the hardware
profile gives for its size:

* every GEMM of the block (tensor-parallel shapes) at ``matmul.at((M·K·N)^(1/3))``;
* fused attention at ``attention.at(s)`` (FLOPs in the convention above, causal mask
  not discounted); unfused attention as two batched GEMMs plus the softmax traffic;
* memory-bound operations (norms, rotary, activation function, residual adds, softmax,
  loss) as bytes read + written over ``elementwise.at(tensor bytes)``; backward moves
  twice the forward's bytes (it reads the saved inputs and the output gradient and
  writes the input gradients);
* a fixed ``op_overhead_s`` per operator call (CPU dispatch; 0 for GPUs);
* a fixed ``block_overhead_s`` per block's forward + backward (module calls, autograd
  bookkeeping, views: what a tiny block costs beyond the rates; 0 for GPU presets);
* the block's sum times the profile's measured composition ratio at its hidden size
  and tokens (:func:`plait.plan.overheads.block_scale`; 1 for GPU presets), or for a
  tensor-parallel block at the calibrated degree the ratio measured for such blocks,
  collectives included (:func:`plait.plan.overheads.tp_block_ratio`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.plan.activations import kv_heads_local
from plait.plan.hardware import Hardware
from plait.plan.layout import Layout
from plait.plan.modelspec import ModelSpec
from plait.plan.overheads import attention_length, block_scale, tp_block_ratio
from plait.plan.query import Query

BACKWARD_FACTOR = 2.0
"""Backward work relative to forward, for GEMMs (dX and dW), attention and memory-bound
operations alike."""


@dataclass(frozen=True)
class Gemm:
    """One (batched) matrix multiplication of the forward pass."""

    name: str
    """Which layer."""
    m: float
    """Rows of the output (tokens)."""
    k: float
    """Reduction dimension."""
    n: float
    """Columns of the output."""
    batch: float = 1.0
    """Independent products of this shape (heads x micro-batch for attention)."""

    @property
    def flops(self) -> float:
        """Forward FLOPs: 2·M·K·N per product."""
        return 2.0 * self.m * self.k * self.n * self.batch

    def seconds(self, hw: Hardware) -> float:
        """Forward time at the profile's rate for this size."""
        return self.flops / hw.matmul.at((self.m * self.k * self.n) ** (1.0 / 3.0))


def _tokens(layout: Layout, seq_len: int) -> float:
    return layout.micro_batch * seq_len / layout.cp


def block_gemms(q: Query, layout: Layout) -> list[Gemm]:
    """The forward GEMMs of one block on one tensor-parallel rank."""
    spec, runtime, seq_len = q.model, q.runtime, q.seq_len
    t = layout.tp
    tok = _tokens(layout, seq_len)
    h, d = spec.hidden, spec.head_dim
    qw = spec.n_heads // t * d
    kv = kv_heads_local(spec, t) * d
    f = spec.ffn_hidden // t
    out = [
        Gemm("attn.wq", tok, h, qw),
        Gemm("attn.wk", tok, h, kv),
        Gemm("attn.wv", tok, h, kv),
        Gemm("attn.wo", tok, qw, h),
    ]
    if spec.style == "llama":
        out += [Gemm("mlp.w1", tok, h, f), Gemm("mlp.w3", tok, h, f), Gemm("mlp.w2", tok, f, h)]
    else:
        out += [Gemm("mlp.fc1", tok, h, f), Gemm("mlp.fc2", tok, f, h)]
    if runtime.attention == "math":
        heads = layout.micro_batch * spec.n_heads / t
        s_q = seq_len / layout.cp
        out += [
            Gemm("attn.scores", s_q, d, seq_len, heads),
            Gemm("attn.values", s_q, seq_len, d, heads),
        ]
    return out


def attention_flops(spec: ModelSpec, layout: Layout, seq_len: int) -> float:
    """Forward FLOPs of core attention on one rank: 4·b·(s/c)·s·(a/t)·d."""
    heads = spec.n_heads / layout.tp
    return 4.0 * layout.micro_batch * (seq_len / layout.cp) * seq_len * heads * spec.head_dim


def block_traffic(q: Query, layout: Layout) -> tuple[float, int]:
    """Forward memory-bound bytes and operator calls of one block on one rank."""
    spec, runtime, precision, seq_len = q.model, q.runtime, q.precision, q.seq_len
    t = layout.tp
    norm_split = t if layout.sequence_parallel else 1
    h, a = spec.hidden, spec.n_heads
    qw = spec.n_heads // t * spec.head_dim
    kv = kv_heads_local(spec, t) * spec.head_dim
    f = spec.ffn_hidden // t
    unfused = spec.style == "llama" and not runtime.fused_norm
    norm_elems = 2 * (6 if unfused else 2) * h / norm_split  # two norms
    resid = 2 * (3 + (1 if runtime.dropout else 0)) * h / norm_split
    tp_elems = 0.0
    ops = 2 * (6 if unfused else 1) + 2 + len(block_gemms(q, layout))
    if spec.style == "llama":
        tp_elems += 9.0 * (qw + kv) + 5.0 * f  # rotary of q and k; silu(gate) * up
        ops += 2 * 7 + 2
    else:
        tp_elems += 2.0 * f  # fused bias + GELU
        ops += 1
    if runtime.attention == "math":
        tp_elems += (2.0 + (3.0 if runtime.dropout else 0.0)) * a / t * seq_len
        ops += 2 if runtime.dropout else 1
    else:
        ops += 1
    tokens = _tokens(layout, seq_len)
    return tokens * (norm_elems + resid + tp_elems) * precision.activation_bytes, ops


@dataclass(frozen=True)
class BlockTime:
    """Seconds of one block for one micro-batch on one rank (compute only)."""

    forward: float
    """Forward pass."""
    backward: float
    """Backward pass (without recomputation)."""
    recompute: float
    """Forward work repeated in backward by activation recomputation."""


def _elementwise_seconds(nbytes: float, ops: int, hw: Hardware, tensor_bytes: float) -> float:
    return nbytes / hw.elementwise.at(max(tensor_bytes, 1.0)) + ops * hw.op_overhead_s


def block_time(q: Query, layout: Layout) -> BlockTime:
    """Forward, backward and recomputation time of one block, one micro-batch."""
    spec, runtime, precision, hw, seq_len = q.model, q.runtime, q.precision, q.hardware, q.seq_len
    gemms = block_gemms(q, layout)
    gemm_f = sum(g.seconds(hw) for g in gemms)
    core_gemm_f = sum(g.seconds(hw) for g in gemms if g.name in ("attn.scores", "attn.values"))
    if runtime.attention == "flash":
        attn_total = (1 + BACKWARD_FACTOR) * attention_flops(spec, layout, seq_len)
        # ring attention runs its kernels on chunks of s/(2cp) keys (plan.overheads)
        rate = hw.attention.at(attention_length(layout, seq_len))
        attn_f = attn_total / rate / (1 + BACKWARD_FACTOR)
    else:
        attn_f = 0.0
    traffic, ops = block_traffic(q, layout)
    tensor = _tokens(layout, seq_len) * spec.hidden * precision.activation_bytes
    ew_f = _elementwise_seconds(traffic, ops, hw, tensor)
    # the block's fixed framework cost (a calibrated profile), a third of it in forward
    fwd = gemm_f + attn_f + ew_f + hw.block_overhead_s / (1 + BACKWARD_FACTOR)
    # what the operators cost together beyond their rates (a calibrated profile's grid;
    # for a tensor-parallel block the grid measured with its collectives, which the
    # step multiplies by the same ratio: plan.tp_comm)
    tokens = _tokens(layout, seq_len)
    tp_ratio = tp_block_ratio(hw, layout, spec.hidden, tokens)
    scale = block_scale(hw, spec.hidden, tokens) if tp_ratio is None else tp_ratio
    fwd *= scale
    bwd = BACKWARD_FACTOR * fwd
    if layout.recompute == "full":
        extra = fwd
    elif layout.recompute == "selective":
        extra = attn_f + core_gemm_f
        if runtime.attention == "math":  # softmax (and dropout) traffic
            extra += (
                _tokens(layout, seq_len)
                * (2.0 + (3.0 if runtime.dropout else 0.0))
                * spec.n_heads
                / layout.tp
                * seq_len
                * precision.activation_bytes
                / hw.elementwise.at(tensor)
            )
    else:
        extra = 0.0
    return BlockTime(fwd, bwd, extra * scale if layout.recompute == "selective" else extra)


@dataclass(frozen=True)
class EdgeTime:
    """Seconds of the embedding (first stage) and the norm + head + loss (last stage)."""

    embed_forward: float
    """Token (and position) lookup."""
    embed_backward: float
    """Scatter-add into the embedding gradient."""
    head_forward: float
    """Final norm, output projection, log-softmax and loss."""
    head_backward: float
    """Their backward."""


def edge_time(q: Query, layout: Layout) -> EdgeTime:
    """Embedding and head time for one micro-batch on one rank."""
    spec, runtime, precision, hw = q.model, q.runtime, q.precision, q.hardware
    seq_len = q.seq_len
    t = layout.tp
    tok = _tokens(layout, seq_len)
    h = spec.hidden
    e = precision.activation_bytes
    tensor = tok * h * e
    vocab_local = math.ceil(spec.vocab / t)
    emb_f = _elementwise_seconds(2 * tok * h * e, 1, hw, tensor)
    emb_b = _elementwise_seconds(3 * tok * h * e + vocab_local * h * e, 2, hw, tensor)
    head = Gemm("head", tok, h, vocab_local)
    unfused = spec.style == "llama" and not runtime.fused_norm
    norm_bytes = (6 if unfused else 2) * tok * h * e
    loss_bytes = 4 * tok * vocab_local * 4  # fp32 log-softmax: max, sum, write, nll
    ops = (6 if unfused else 1) + 3
    head_f = head.seconds(hw) + _elementwise_seconds(
        norm_bytes + loss_bytes, ops, hw, tok * vocab_local * 4
    )
    return EdgeTime(emb_f, emb_b, head_f, BACKWARD_FACTOR * head_f)


def hardware_flops_per_token(spec: ModelSpec, seq_len: int, recompute: str) -> float:
    """FLOPs per token actually executed. Full recomputation repeats every block's
    forward (``2·N_blocks + 4·L·s·a·d``; the head is not recomputed, as in Narayanan et
    al. 2021, eq. 3, whose 96·B·s·l·h² counts four passes over the blocks and three over
    the head); selective recomputation repeats the attention forward ``4·L·s·a·d``."""
    model = spec.flops_per_token(seq_len)
    attn_fwd = 4.0 * spec.n_layers * seq_len * spec.q_width
    if recompute == "full":
        return model + 2.0 * spec.n_layers * spec.layer_matmul_params() + attn_fwd
    if recompute == "selective":
        return model + attn_fwd
    return model
