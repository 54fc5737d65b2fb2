"""One bit per entry of top-k's residual: a scaled sign of every matrix entry not sent.

With Adam before the sparsification (:mod:`.adam_local`) every entry of the residual is
a pending *update* on Adam's common scale, so a top-k at rho = 1 % sends about one entry
in a hundred per step and the rest wait; the wait grows with the run
(docs/compression.md). This channel sends the rest of each matrix's residual coarsely,
as in error-feedback signSGD (Karimireddy et al. 2019) and 1-bit Adam (Tang et al. 2021):
for each matrix-shaped tensor i of the bucket, after the top-k entries have been taken
out of the residual e_i (``(n_i,)``),

    s_i = c * mean(|e_i|)                    # one scale per tensor (c: sign_scale)
    q_i = s_i * (+1 where e_i > 0 else -1)   # one bit per entry
    q_i = 0 at the entries this rank sent by top-k this step
    e_i <- e_i - q_i                         # error feedback keeps what q_i missed

and q travels as the scales (value dtype) and the packed bits (``ceil(M / 8)`` bytes for
the bucket's M matrix entries), appended to top-k's AllGather message. Every rank decodes
every rank's q (the receiver knows which entries that rank sent from its indices) and
adds it to the sum, in rank order. Vectors go whole through top-k and get no bits.

The scale c: c = 1 minimises |e - q| for one step; a larger c moves every entry further
and error feedback takes the overshoot back at the next step. With every |e_j| equal
one step maps e to (1 - c) e, so the residual oscillates and decays for 0 < c < 2 and
grows for c > 2 (c = 3 diverged in the simulation of docs/compression.md); c = 1.8
converged best of the scales measured there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
"""Bit j of a packed byte is element 8 * b + j."""


def matrix_spans(shapes: Sequence[torch.Size]) -> list[tuple[int, int]]:
    """``(offset, numel)`` in the bucket of each matrix-shaped tensor (``len(shape) >= 2``)."""
    out, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        if len(shape) >= 2:
            out.append((offset, size))
        offset += size
    return out


def sign_bytes(shapes: Sequence[torch.Size], value_bytes: int) -> int:
    """Bytes the sign channel adds to one rank's message for a bucket: one scale per
    matrix plus one bit per matrix entry (rounded up to whole bytes)."""
    spans = matrix_spans(shapes)
    return len(spans) * value_bytes + math.ceil(sum(n for _, n in spans) / 8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``(M,)`` bool -> ``(ceil(M / 8),)`` uint8, bit j of byte b = element 8 * b + j."""
    pad = (-bits.numel()) % 8
    b = torch.cat([bits.to(torch.uint8), bits.new_zeros(pad, dtype=torch.uint8)])
    return (b.view(-1, 8) * BIT_WEIGHTS.to(b.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``(ceil(count / 8),)`` uint8 -> ``(count,)`` bool."""
    w = BIT_WEIGHTS.to(packed.device)
    return ((packed.view(-1, 1) & w) != 0).reshape(-1)[:count]


def encode(
    err: torch.Tensor, sent: torch.Tensor, shapes: Sequence[torch.Size], scale: float = 1.8
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's sign message and its q: ``err`` ``(n,)`` is the residual after top-k
    (zero at the ``sent`` offsets ``(k,)``); each matrix's magnitude is ``scale`` times
    its mean ``|err|``. Returns (``(sign_bytes,)`` uint8 message, ``(n,)`` q in err's
    dtype, zero outside the matrices and at ``sent``)."""
    spans = matrix_spans(shapes)
    scales = torch.stack([err[o : o + n].abs().mean() * scale for o, n in spans])  # (n_mat,)
    bits = torch.cat([err[o : o + n] > 0 for o, n in spans])  # (M,)
    q = decode_parts(scales, bits, sent, shapes, err)
    message = torch.cat([scales.contiguous().view(torch.uint8), pack_bits(bits)])
    return message, q


def decode(
    message: torch.Tensor, sent: torch.Tensor, shapes: Sequence[torch.Size], like: torch.Tensor
) -> torch.Tensor:
    """A rank's q ``(n,)`` (``like``'s dtype and size) from its sign ``message`` (uint8) and
    the offsets ``sent`` ``(k,)`` it sent by top-k."""
    spans = matrix_spans(shapes)
    vb = like.element_size()
    scales = message[: len(spans) * vb].clone().view(like.dtype)  # (n_mat,) (clone: aligned)
    bits = unpack_bits(message[len(spans) * vb :], sum(n for _, n in spans))  # (M,)
    return decode_parts(scales, bits, sent, shapes, like)


def decode_parts(
    scales: torch.Tensor,
    bits: torch.Tensor,
    sent: torch.Tensor,
    shapes: Sequence[torch.Size],
    like: torch.Tensor,
) -> torch.Tensor:
    """q ``(n,)``: ``+-scales[i]`` over matrix i by ``bits``, zero elsewhere and at ``sent``."""
    q = torch.zeros_like(like)
    pos = 0
    for (o, n), s in zip(matrix_spans(shapes), scales, strict=True):
        sign = bits[pos : pos + n].to(like.dtype) * 2 - 1  # (n_i,) +1 / -1
        q[o : o + n] = sign * s
        pos += n
    q[sent] = 0
    return q
