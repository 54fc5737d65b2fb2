"""ZeRO's flat units as the runtime builds them: exact per-rank state bytes with padding.

:class:`plait.parallel.zero.ZeroDataParallel` flattens the parameters of each *unit*
(the token embedding, every transformer block, the output head; the final norm and
any tied matrix stay in the root unit, last) into one buffer padded with zeros to a
multiple of the shard count F, and gives rank ``r`` of a shard group the elements
``[r·S, (r+1)·S)``, ``S = ceil(numel / F)`` (:mod:`plait.parallel.zero.flat`). The
sharded optimizer keeps one parameter per piece of a tensor inside that range, so
Adam's per-tensor ``step`` scalar is counted per piece and its moments cover only the
non-padding elements. With N parameters the result differs from the textbook
``ceil(N/F)`` shard by the padding of each unit, a few elements per unit:
:func:`zero_state_bytes` gives the exact figure for one rank.
"""

from __future__ import annotations

import functools
import math

from plait.plan.activations import kv_heads_local
from plait.plan.layout import Precision
from plait.plan.lora import COLUMN_TARGETS, LoraSpec
from plait.plan.modelspec import ModelSpec

Unit = tuple[int, ...]
"""Element counts of a unit's tensors, in the order they are flattened."""


def stage_layers(n_layers: int, pp: int, stage: int, edge_trim: int = 0) -> int:
    """Blocks on pipeline stage ``stage``: as even as possible, the first stages take
    the remainder; with ``edge_trim`` k the pipeline is split as if it had ``2k`` more
    blocks and the first and the last stage each hold k fewer (they also hold the
    embedding and the head; Llama 3 405B's 126 blocks are 16 stages of 8 less 2)."""
    if edge_trim and pp > 1:
        n = n_layers + 2 * edge_trim
        edge = edge_trim if stage in (0, pp - 1) else 0
        return max(0, n // pp + (1 if stage < n % pp else 0) - edge)
    return n_layers // pp + (1 if stage < n_layers % pp else 0)


def block_tensors(spec: ModelSpec, tp: int) -> Unit:
    """One block's tensors on one tensor-parallel rank, in module order (plait's
    ``Block``: attention norm, wq, wk, wv, wo, MLP norm, w1, w3, w2)."""
    h, d = spec.hidden, spec.head_dim
    q = spec.n_heads // tp * d
    kv = kv_heads_local(spec, tp) * d
    f = spec.ffn_hidden // tp
    if spec.style == "llama":
        return (h, q * h, kv * h, kv * h, h * q, h, f * h, f * h, h * f)
    # gpt: ln1 (gain, bias), q/k/v/o (weight, bias), ln2, fc1, fc2
    return (h, h, q * h, q, kv * h, kv, kv * h, kv, h * q, h, h, h, f * h, f, h * f, h)


def lora_unit(spec: ModelSpec, tp: int, lora: LoraSpec) -> Unit:
    """One block's adapter factors on one tensor-parallel rank, in module order (A then
    B of each target): a column-parallel layer ``(in -> out)`` keeps A ``r·in`` whole and
    B ``(out/t)·r``; a row-parallel one A ``r·(in/t)`` and B ``out·r`` whole."""
    h, d, r = spec.hidden, spec.head_dim, lora.rank
    q = spec.n_heads // tp * d
    kv = kv_heads_local(spec, tp) * d
    f = spec.ffn_hidden // tp
    local_out = {"q": q, "k": kv, "v": kv, "gate": f, "up": f}  # column: (in h, out local)
    local_in = {"o": spec.n_heads // tp * d, "down": f}  # row: (in local, out h)
    out: list[int] = []
    for t in lora.ordered:
        if t in COLUMN_TARGETS:
            out += [r * h, local_out[t] * r]
        else:
            out += [r * local_in[t], h * r]
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def stage_units(
    spec: ModelSpec, tp: int, pp: int, stage: int, edge_trim: int = 0
) -> tuple[Unit, ...]:
    """The units of one tensor-parallel rank of pipeline stage ``stage`` (root last)."""
    h = spec.hidden
    vocab = math.ceil(spec.vocab / tp) * h  # vocabulary-parallel rows, padded to t
    first, last = stage == 0, stage == pp - 1
    tied_here = spec.tie_embeddings and first and last  # one matrix, two users: root
    units: list[Unit] = []
    if first and not tied_here:
        units.append((vocab,))
    if first and spec.style == "gpt":
        units.append((spec.max_positions * h,))
    units += [block_tensors(spec, tp)] * stage_layers(spec.n_layers, pp, stage, edge_trim)
    root: list[int] = []
    if tied_here:
        root.append(vocab)
    if last:
        norm = (h, h) if spec.bias else (h,)
        if pp > 1 and not spec.tie_embeddings:
            # the split's last piece is a unit of its own: final norm, then the head
            units.append((*norm, vocab))
        else:
            if spec.tie_embeddings and not tied_here:
                units.append((vocab,))  # the last stage's own copy of the tied matrix
            elif not spec.tie_embeddings:
                units.append((vocab,))
            root += norm
    if root:
        units.append(tuple(root))
    return tuple(units)


def shard_numel(unit: Unit, f: int) -> int:
    """Elements of one rank's shard of ``unit``: ceil(numel / F)."""
    return math.ceil(sum(unit) / f)


def local_pieces(unit: Unit, f: int, rank: int) -> tuple[int, int]:
    """``(tensor pieces, non-padding elements)`` in shard ``rank`` of ``unit``."""
    s = shard_numel(unit, f)
    lo, hi = rank * s, (rank + 1) * s
    pieces = valid = 0
    off = 0
    for n in unit:
        a, b = max(off, lo), min(off + n, hi)
        if a < b:
            pieces += 1
            valid += b - a
        off += n
    return pieces, valid


def zero_state_bytes(
    units: tuple[Unit, ...], zero: int, f: int, rank: int, precision: Precision
) -> tuple[float, float, float, float]:
    """``(weights, gradients, master, optimizer)`` bytes on rank ``rank`` of a shard group
    of ``f`` under ZeRO stage ``zero`` >= 1, as the runtime allocates them.

    Weights: the padded flat buffer (stages 1-2) or its shard (3). Gradients: the padded
    full buffer (1) or the shard (2-3). Master: fp32 shards, none when the weights are
    fp32 (the shard is the master). Optimizer: state per non-padding element plus the
    per-tensor scalars of each piece.
    """
    pr = precision
    shards = [shard_numel(u, f) for u in units]
    padded = [s * f for s in shards]
    pieces = [local_pieces(u, f, rank) for u in units]
    weights = sum(shards if zero >= 3 else padded) * pr.param_bytes
    grads = sum(shards if zero >= 2 else padded) * pr.grad_bytes
    master = sum(shards) * pr.master_bytes
    optimizer = sum(v for _, v in pieces) * pr.optimizer_bytes
    optimizer += sum(n for n, _ in pieces) * pr.optimizer_tensor_bytes
    return float(weights), float(grads), float(master), float(optimizer)
