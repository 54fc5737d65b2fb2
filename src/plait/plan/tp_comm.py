"""Tensor-parallel communication of one micro-batch on one rank (Megatron-LM's f and g
operators, Shoeybi et al. 2019; with sequence parallelism their all-gather /
reduce-scatter form, Korthikanti et al. 2022).

Every collective here is issued synchronously between compute, so each is charged its
in-step cost (:func:`plait.plan.network.in_step_all_reduce_time`: the profile's
measurement where it has one, else the alpha-beta time). Per block and micro-batch:

* without sequence parallelism, 4 all-reduces of the ``(b, s/c, h)`` hidden states (the
  attention and MLP outputs in forward, their inputs' gradients in backward), 2 more
  with full recomputation;
* with it, each all-reduce becomes a reduce-scatter and an all-gather, each moving the
  bytes of an all-reduce of half the tensor, plus one small all-reduce per norm gain
  (its gradient summed over tp, plait's ``sum_grad_over``).

Outside the blocks: the embedding's output (vocabulary-parallel) and the head's input
gradient, one hidden-state all-reduce each (two halves with sequence parallelism); the
vocabulary-parallel loss all-reduces the tokens' max logit (``b·s/c`` fp32) and their
target logit and sum of exponentials (``2·b·s/c`` fp32); with sequence parallelism the
final norm's gain.

A profile with a tensor-parallel block grid (:func:`plait.plan.overheads.tp_block_ratio`)
multiplies the block's collectives by the ratio measured for the whole block, as
:func:`plait.plan.compute.block_time` does its compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan.layout import Layout
from plait.plan.network import group, in_step_all_reduce_time
from plait.plan.overheads import tp_block_ratio
from plait.plan.query import Query


def activation_message_bytes(q: Query, layout: Layout) -> float:
    """Bytes of one micro-batch's hidden states on one rank: b·(s/c)·h·e."""
    tokens = layout.micro_batch * q.seq_len / layout.cp
    return tokens * q.model.hidden * q.precision.activation_bytes


@dataclass(frozen=True)
class TPComm:
    """Seconds of tensor-parallel collectives per micro-batch on one rank."""

    block: float
    """One block's (forward, backward and a full recomputation's second forward)."""
    edge: float
    """The embedding's output, or the head's input gradient (each stage edge pays one)."""
    loss: float
    """The vocabulary-parallel cross-entropy's all-reduces (last stage)."""
    gain: float
    """The final norm's gain gradient sum under sequence parallelism (last stage)."""


def tp_comm_time(q: Query, layout: Layout) -> TPComm:
    """The tensor-parallel collectives of one micro-batch (all 0 at tp = 1)."""
    spec, hw, precision = q.model, q.hardware, q.precision
    tokens = layout.micro_batch * q.seq_len / layout.cp
    msg = activation_message_bytes(q, layout)  # (b, s/c, h)
    tp_g = group(layout, hw, "tp")
    n_tp = 4 + (2 if layout.recompute == "full" else 0)
    gain = 0.0
    if layout.sequence_parallel and layout.tp > 1:
        half = in_step_all_reduce_time(msg / 2, tp_g.size, tp_g.link)
        gain = in_step_all_reduce_time(spec.hidden * precision.grad_bytes, tp_g.size, tp_g.link)
        block, edge = 2 * n_tp * half + 2 * gain, 2 * half
    else:
        tp_ar = in_step_all_reduce_time(msg, tp_g.size, tp_g.link)
        block, edge = n_tp * tp_ar, tp_ar
    tok_bytes = 4.0 * tokens
    loss = in_step_all_reduce_time(tok_bytes, tp_g.size, tp_g.link) + (
        in_step_all_reduce_time(2 * tok_bytes, tp_g.size, tp_g.link)
    )
    ratio = tp_block_ratio(hw, layout, spec.hidden, tokens)
    return TPComm(block * (1.0 if ratio is None else ratio), edge, loss, gain)
