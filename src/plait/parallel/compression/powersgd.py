"""PowerSGD: rank-r gradient compression by one step of power iteration, with error
feedback (Vogels, Karimireddy & Jaggi, NeurIPS 2019, Algorithm 1).

For each matrix-shaped gradient (a tensor of shape ``(m, ...)`` viewed as
``M: (m, n)``) plus its error buffer, with ``Q: (n, r)`` warm-started from the previous
step (seeded standard normal at first, the same on every rank)::

    Q = orthogonalise(Q)       # a warm start from a rank-deficient step regains rank
    P = M Q                    # (m, r)
    P = AllReduce(P)           # sum over ranks
    P = orthogonalise(P)       # reduced QR: orthonormal columns
    Q = M^T P                  # (n, r), this rank's
    error = M - P Q^T          # this rank's unsent remainder (kept for the next step)
    Q = AllReduce(Q)           # sum over ranks
    M ~ P Q^T                  # the (pre-divided) sum, identical on every rank

Each round packs every matrix of the bucket into one all-reduce. Vectors (biases, norm
weights) and matrices too small to gain (``m * n < min_compression_rate * (m + n) * r``)
go uncompressed in one asynchronous all-reduce that overlaps the two rounds. Wire bytes
per bucket: all-reduces of ``sum (m + n) * r`` elements for the matrices plus the
uncompressed elements. With ``r >= min(m, n)`` the projection ``P P^T`` is the identity
on M's column space and the result equals the plain all-reduce.

Every round is issued from the calling thread and waited before the next one starts;
no completion callback issues a collective (the gloo deadlock of chained futures cannot
happen).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from plait import comm
from plait.comm import AxisGroup
from plait.parallel.compression.compressor import Compressor, Finish


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """``(m, n)`` a tensor is viewed as, or None for a vector/scalar."""
    if len(shape) < 2:
        return None
    m = int(shape[0])
    return m, math.prod(int(s) for s in shape[1:])


def _orthogonalise(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p``'s (``(m, r)``) column space (reduced QR)."""
    if p.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.qr(p.float(), mode="reduced").Q.to(p.dtype)
    return torch.linalg.qr(p, mode="reduced").Q


class PowerSGDCompressor(Compressor):
    """Rank-``rank`` PowerSGD per matrix, error feedback, warm-started Q.

    Args:
        rank: the approximation rank r (capped per matrix at min(m, n)).
        start: plain all-reduce steps before compression begins (``start_iter``).
        min_compression_rate: compress a matrix only when ``m * n`` is at least this many
            times ``(m + n) * r`` (2, as PyTorch's hook; 0 compresses every matrix).
        seed: seed of the initial Q (the same on every rank).
    """

    name = "powersgd"
    error_feedback = True

    def __init__(
        self, rank: int, start: int = 0, min_compression_rate: float = 2.0, seed: int = 0
    ) -> None:
        super().__init__(start)
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        self.rank = rank
        self.min_compression_rate = min_compression_rate
        self.seed = seed
        self.qs: dict[tuple[int, int], torch.Tensor] = {}
        """Per (bucket, tensor position): ``(n, r)`` the warm-start Q."""

    def plan(self, shapes: Sequence[torch.Size]) -> list[tuple[int, int, int] | None]:
        """Per tensor: ``(m, n, r)`` when it is compressed, else None."""
        out: list[tuple[int, int, int] | None] = []
        for shape in shapes:
            mn = matrix_shape(shape)
            if mn is None:
                out.append(None)
                continue
            m, n = mn
            r = min(self.rank, m, n)
            out.append((m, n, r) if m * n >= self.min_compression_rate * (m + n) * r else None)
        return out

    def _q(self, key: int, i: int, n: int, r: int, like: torch.Tensor) -> torch.Tensor:
        q = self.qs.get((key, i))
        if q is None or q.shape != (n, r):
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + key * 1009 + i)
            q = torch.randn(n, r, generator=gen, dtype=torch.float64)
            q = q.to(device=like.device, dtype=like.dtype)
            self.qs[(key, i)] = q
        elif q.device != like.device:
            q = self.qs[(key, i)] = q.to(like.device)
        return q

    def reduce(
        self, key: int, flat: torch.Tensor, shapes: Sequence[torch.Size], group: AxisGroup
    ) -> Finish:
        err = self.error_of(key, flat)
        flat.add_(err)  # (numel,) M: gradient plus the unsent remainder
        err.zero_()
        views, offset = [], 0
        for shape in shapes:
            size = math.prod(shape)
            views.append(flat[offset : offset + size])
            offset += size
        plan = self.plan(shapes)
        plain_ix = [i for i, p in enumerate(plan) if p is None]
        packed = [i for i, p in enumerate(plan) if p is not None]
        plain = torch.cat([views[i] for i in plain_ix]) if plain_ix else flat.new_zeros(0)
        sent = flat.clone() if self.keep_sent else None
        handle = comm.all_reduce(plain, group, op="sum", async_op=True) if plain_ix else None
        if packed:
            mats = []
            for i in packed:
                m, n, _ = plan[i]  # type: ignore[misc]
                mats.append(views[i].view(m, n))  # (m, n)
            qs = [  # (n, r) each, orthonormal: a warm start that lost rank regains it
                _orthogonalise(self._q(key, i, plan[i][1], plan[i][2], flat))  # type: ignore[index]
                for i in packed
            ]
            p_all = torch.cat([(mat @ q).reshape(-1) for mat, q in zip(mats, qs, strict=True)])
            comm.all_reduce(p_all, group, op="sum")  # round 1: sum of P = M Q
            ps, off = [], 0
            for i in packed:
                m, _, r = plan[i]  # type: ignore[misc]
                ps.append(_orthogonalise(p_all[off : off + m * r].view(m, r)))  # (m, r)
                off += m * r
            q_local = [mat.t() @ p for mat, p in zip(mats, ps, strict=True)]  # (n, r) each
            for i, mat, p, q in zip(packed, mats, ps, q_local, strict=True):
                own = p @ q.t()  # (m, n) this rank's contribution: P P^T M
                err[self._span(views, i)] = (mat - own).reshape(-1)
                if sent is not None:
                    sent[self._span(views, i)] = own.reshape(-1)
            q_all = torch.cat([q.reshape(-1) for q in q_local])
            comm.all_reduce(q_all, group, op="sum")  # round 2: sum of Q = M^T P
            off = 0
            for i, p in zip(packed, ps, strict=True):
                _, n, r = plan[i]  # type: ignore[misc]
                q_sum = q_all[off : off + n * r].view(n, r)
                off += n * r
                views[i].copy_((p @ q_sum.t()).reshape(-1))
                self.qs[(key, i)] = q_sum.clone()  # warm start for the next step
        if sent is not None:
            self._record_sent(key, sent)

        def finish() -> None:
            if handle is not None:
                handle.wait()
                off = 0
                for i in plain_ix:
                    size = views[i].numel()
                    views[i].copy_(plain[off : off + size])
                    off += size

        return finish

    @staticmethod
    def _span(views: list[torch.Tensor], i: int) -> slice:
        start = sum(v.numel() for v in views[:i])
        return slice(start, start + views[i].numel())

    def wire_elements(self, shapes: Sequence[torch.Size]) -> tuple[int, int]:
        """``(compressed, plain)`` elements all-reduced per step for a bucket: the sum of
        ``(m + n) * r`` over compressed matrices, and the uncompressed elements."""
        compressed = plain = 0
        for shape, p in zip(shapes, self.plan(shapes), strict=True):
            if p is None:
                plain += math.prod(shape)
            else:
                compressed += (p[0] + p[1]) * p[2]
        return compressed, plain

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = super().state_dict()
        for (k, i), q in self.qs.items():
            out[f"q/{k}/{i}"] = q
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        self.qs = {}
        for name, v in state.items():
            if name.startswith("q/"):
                _, k, i = name.split("/")
                self.qs[(int(k), int(i))] = v.clone()

    def describe(self) -> str:
        return f"{super().describe()} (rank {self.rank}, error feedback)"
