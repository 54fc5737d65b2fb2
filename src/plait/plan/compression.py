"""Gradient compression in the data-parallel time model (no torch).

What :mod:`plait.parallel.compression` puts on the wire per step, for one rank's
gradients of ``P`` parameters over a data-parallel group of ``N`` ranks (``b`` bytes per
gradient element):

* ``none``: all-reduce of ``P * b`` bytes, bucketed and overlapped with backward;
* ``fp16`` / ``bf16``: all-reduce of ``P * 2`` bytes, bucketed and overlapped;
* ``topk`` (ratio rho): all-gather of ``N * k * (4 + b)`` bytes, ``k = rho * P`` (int32
  indices, values in the gradient dtype), plus the selection (a few passes over the
  gradients); it runs inside the backward hooks, so it is not overlapped;
* ``powersgd`` (rank r): all-reduces of ``b * (sum over matrices of (m + n) * r' + the
  uncompressed elements)``, ``r' = min(r, m, n)``, matrices compressed only where
  ``m * n >= 2 * (m + n) * r'``; plus two ``(m x n) @ (n x r')``-sized GEMMs per matrix
  and a QR of each ``P``; also not overlapped.

The matrices are the model's, with the tensor-parallel dimension divided by tp, and a
pipeline stage holds its share of them in proportion to its parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.plan.hardware import Hardware
from plait.plan.modelspec import ModelSpec

INDEX_BYTES = 4
"""Bytes of one top-k index on the wire (int32)."""
MIN_COMPRESSION_RATE = 2.0
"""PowerSGD compresses a matrix only when m·n >= this × (m + n)·r (as PyTorch's hook)."""


def matrices(spec: ModelSpec, tp: int) -> tuple[list[tuple[int, int]], int]:
    """``([(m, n), ...], vector elements)`` of one tp rank's copy of the whole model."""
    h, f, v = spec.hidden, spec.ffn_hidden, spec.vocab
    kv = spec.n_kv_heads * (h // spec.n_heads)
    per_layer = [
        (h // tp, h),  # wq (column-parallel)
        (max(1, kv // tp), h),  # wk
        (max(1, kv // tp), h),  # wv
        (h, h // tp),  # wo (row-parallel)
        (f // tp, h),  # gate
        (f // tp, h),  # up
        (h, f // tp),  # down
    ]
    if spec.style == "gpt":
        per_layer = [
            per_layer[0],
            per_layer[1],
            per_layer[2],
            per_layer[3],
            per_layer[5],
            per_layer[6],
        ]
    mats = per_layer * spec.n_layers
    mats.append((math.ceil(v / tp), h))  # token embedding
    if not spec.tie_embeddings:
        mats.append((math.ceil(v / tp), h))  # output head
    vectors = spec.n_layers * 2 * h + h  # norm weights (biases of gpt are small too)
    return mats, vectors


def powersgd_elements(spec: ModelSpec, tp: int, rank: int) -> tuple[int, int, float]:
    """``(compressed elements, uncompressed elements, GEMM FLOPs)`` per step for one tp
    rank's copy of the whole model."""
    mats, plain = matrices(spec, tp)
    sent = 0
    flops = 0.0
    for m, n in mats:
        r = min(rank, m, n)
        if m * n >= MIN_COMPRESSION_RATE * (m + n) * r:
            sent += (m + n) * r
            flops += 2 * (2.0 * m * n * r) + 2.0 * m * r * r  # P = MQ, Q = M^T P, QR
        else:
            plain += m * n
    return sent, plain, flops


@dataclass(frozen=True)
class CompressedTraffic:
    """One rank's data-parallel traffic per step under a compression method."""

    wire_bytes: float
    """Bytes the collective moves (its tensor size S in :mod:`plait.comm.stats`)."""
    op: str
    """``all_reduce`` or ``all_gather``."""
    compute_s: float
    """Seconds of compression work (selection, GEMMs, casts)."""
    overlapped: bool
    """Whether the traffic hides under backward (the cast methods) or blocks it."""


def traffic(
    spec: ModelSpec,
    hw: Hardware,
    method: str,
    params: int,
    grad_bytes: int,
    n: int,
    tp: int,
    ratio: float,
    rank: int,
) -> CompressedTraffic:
    """The traffic of ``method`` for ``params`` gradient elements (one stage's)."""
    grads = params * grad_bytes
    passes = grads / hw.elementwise.at(max(grads, 1.0))  # one read + write of the gradients
    if method in ("fp16", "bf16"):
        return CompressedTraffic(params * 2.0, "all_reduce", 2 * passes, True)
    if method == "topk":
        k = max(1.0, ratio * params)
        wire = n * k * (INDEX_BYTES + grad_bytes)
        return CompressedTraffic(wire, "all_gather", 4 * passes, False)
    if method == "powersgd":
        sent, plain, flops = powersgd_elements(spec, tp, rank)
        whole = sum(m * nn for m, nn in matrices(spec, tp)[0]) + matrices(spec, tp)[1]
        share = params / max(1, whole)  # a pipeline stage's fraction of the model
        size = (spec.hidden * spec.hidden * max(1, rank)) ** (1 / 3)  # a typical GEMM
        gemm = flops * share / hw.matmul.at(size)
        elems = (sent + plain) * share
        return CompressedTraffic(elems * grad_bytes, "all_reduce", gemm + 3 * passes, False)
    return CompressedTraffic(float(grads), "all_reduce", 0.0, True)
