"""Building blocks of :mod:`plait.collectives.algorithms`: traffic metering from the comm
counters, the cross-rank shape check, metered message rounds, and the pipelined ring
phases.

Everything here uses only plait's counted point-to-point operations
(:func:`plait.comm.isend` / :func:`plait.comm.irecv`) and, for the shape check and the
gathering of measurements, the library's counted ``all_gather``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from plait.collectives import costs
from plait.collectives.costs import Cost
from plait.comm import ops
from plait.comm.group import AxisGroup, Handle

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
_MAX_DIMS = 8


@dataclass(frozen=True)
class Report:
    """What one algorithm call reports: the closed form and, when asked for, the
    traffic measured from the comm counters of every rank."""

    formula: Cost
    measured: Cost | None = None


class Meter:
    """Per-round traffic of this rank, read from the group's :class:`CommStats`.

    Every message an algorithm posts is posted inside ``with meter.at(k)``, ``k`` being
    the round of the global schedule it belongs to; the counter deltas (send/recv calls
    and bytes) of the block are added to round ``k``. Bytes are what the counters
    recorded, not what the algorithm thinks it sent.
    """

    def __init__(self, g: AxisGroup, rounds: int) -> None:
        self.g = g
        self.counts = torch.zeros(rounds, 4, dtype=torch.int64)  # (round, [sc, rc, sb, rb])

    def _read(self) -> tuple[int, int, int, int]:
        s = self.g.stats.get(self.g.name, "send")
        r = self.g.stats.get(self.g.name, "recv")
        return s.calls, r.calls, int(s.bytes), int(r.bytes)

    @contextlib.contextmanager
    def at(self, k: int) -> Iterator[None]:
        """Attribute the messages posted in the block to round ``k``."""
        before = self._read()
        yield
        after = self._read()
        for col in range(4):
            self.counts[k, col] += after[col] - before[col]

    def gather(self, algorithm: str, nbytes: int) -> Cost:
        """Exchange every rank's per-round counts (one all-gather) and build the
        measured :class:`Cost`: steps are rounds in which any rank posted a message,
        critical bytes the sum over rounds of the most bytes one rank moved one way."""
        rounds = self.counts.shape[0]
        flat = self.counts.reshape(1, -1)  # (1, rounds*4)
        if self.g.size > 1:
            every = ops.all_gather(flat, self.g)
            assert isinstance(every, torch.Tensor)
        else:
            every = flat
        per = every.reshape(self.g.size, rounds, 4)  # (rank, round, [sc, rc, sb, rb])
        active = (per[:, :, 0] + per[:, :, 1]).sum(0) > 0  # (round,)
        sent = tuple(int(v) for v in per[:, :, 2].sum(1))
        recv = tuple(int(v) for v in per[:, :, 3].sum(1))
        crit = int(torch.maximum(per[:, :, 2], per[:, :, 3]).amax(0).sum())
        return Cost(algorithm, self.g.size, nbytes, int(active.sum()), sent, recv, crit)

    def report(self, algorithm: str, t: torch.Tensor, measure: bool) -> Report:
        """The call's :class:`Report`: the closed form of ``algorithm`` for ``t`` over this
        group and, with ``measure``, the traffic measured (:meth:`gather`)."""
        numel, size = t.numel(), t.element_size()
        formula = costs.formula(algorithm, self.g.size, numel, size)
        return Report(formula, self.gather(algorithm, numel * size) if measure else None)


def send_step(x: torch.Tensor, g: AxisGroup, dst: int, meter: Meter, k: int) -> None:
    """Round ``k`` of the schedule: send ``x`` to rank ``dst`` of ``g`` and wait."""
    with meter.at(k):
        h = ops.isend(x, g, dst)
    h.wait()


def recv_step(buf: torch.Tensor, g: AxisGroup, src: int, meter: Meter, k: int) -> None:
    """Round ``k`` of the schedule: receive ``buf`` from rank ``src`` of ``g`` and wait."""
    with meter.at(k):
        h = ops.irecv(buf, g, src)
    h.wait()


def exchange_step(
    sends: list[torch.Tensor], recvs: list[torch.Tensor], g: AxisGroup, meter: Meter, k: int
) -> None:
    """Round ``k``: this rank sends ``sends[j]`` to every other rank j and receives
    ``recvs[j]`` from it, all posted at once, then waits for all of them."""
    i, n = g.index, g.size
    with meter.at(k):
        hs = [ops.isend(sends[j], g, j) for j in range(n) if j != i]
        hs += [ops.irecv(recvs[j], g, j) for j in range(n) if j != i]
    for h in hs:
        h.wait()


def check_same_shape(t: torch.Tensor, g: AxisGroup, what: str) -> None:
    """Raise ``ValueError`` on every rank if ``t``'s shape or dtype differs across the
    group (one small all-gather; every rank sees the same table, so all raise together
    instead of hanging in a mismatched exchange)."""
    if g.size == 1:
        return
    shape = tuple(t.shape)
    code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES)
    dims = list(shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(len(shape), _MAX_DIMS))
    tail = hash(shape) & (2**62 - 1)  # ints hash deterministically across processes
    mine = torch.tensor([[len(shape), code, t.numel(), tail, *dims]], dtype=torch.int64)
    every = ops.all_gather(mine, g)
    assert isinstance(every, torch.Tensor)
    rows = [tuple(int(v) for v in row) for row in every]  # (rank, 4 + _MAX_DIMS)
    if all(row == rows[0] for row in rows):
        return

    def show(row: tuple[int, ...]) -> str:
        ndim, c = row[0], row[1]
        dt = str(_DTYPES[c]).replace("torch.", "") if c < len(_DTYPES) else "other dtype"
        dims_s = ", ".join(str(d) for d in row[4 : 4 + min(ndim, _MAX_DIMS)])
        more = ", ..." if ndim > _MAX_DIMS else ""
        return f"({dims_s}{more}) {dt}"

    table = "; ".join(f"rank {i}: {show(row)}" for i, row in enumerate(rows))
    raise ValueError(
        f"{what} on axis '{g.name}': the tensor differs in shape or dtype across ranks "
        f"({table}); every rank must pass a tensor of the same shape and dtype"
    )


def pieces(numel: int, parts: int) -> list[tuple[int, int]]:
    """``(start, length)`` of ``max(1, min(parts, numel))`` balanced pieces of a chunk
    (one empty piece for an empty chunk, so every round still sends one message)."""
    k = max(1, min(parts, numel))
    out, start = [], 0
    for i in range(k):
        length = numel // k + (1 if i < numel % k else 0)
        out.append((start, length))
        start += length
    return out


def _post_sends(
    chunk: torch.Tensor, parts: int, g: AxisGroup, dst: int, meter: Meter, k: int
) -> list[Handle]:
    with meter.at(k):
        return [ops.isend(chunk[a : a + n], g, dst) for a, n in pieces(chunk.numel(), parts)]


def ring_reduce_scatter_phase(
    chunks: list[torch.Tensor], g: AxisGroup, meter: Meter, base: int, parts: int
) -> None:
    """In place over the 1-D views ``chunks`` (one per rank): afterwards ``chunks[r]``
    on rank r holds the sum over ranks (N-1 rounds, Patarasuk & Yuan 2009).

    In round k rank r sends chunk (r-1-k) to r+1 and receives chunk (r-2-k) from r-1,
    adding it to its own. Each chunk travels in ``parts`` pieces and a piece is
    forwarded in round k+1 as soon as it has been reduced in round k (pipelining).
    Deadlock-free: the receive of (k, j) waits only on the sender's (k-1, j), and every
    rank posts its sends to r+1 in the order r+1 posts the matching receives.
    """
    n, r = g.size, g.index
    if n == 1:
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    rounds = n - 1
    biggest = max(c.numel() for c in chunks)
    bufs = [torch.empty(biggest, dtype=chunks[0].dtype, device=chunks[0].device) for _ in "ab"]

    def post_recvs(k: int) -> list[tuple[Handle, int, int]]:
        q, buf = (r - 2 - k) % n, bufs[k % 2]
        with meter.at(base + k):
            return [
                (ops.irecv(buf[a : a + m], g, prv), a, m)
                for a, m in pieces(chunks[q].numel(), parts)
            ]

    sends = _post_sends(chunks[(r - 1) % n], parts, g, nxt, meter, base)
    cur = post_recvs(0)
    for k in range(rounds):
        ahead = post_recvs(k + 1) if k + 1 < rounds else []
        q, buf = (r - 2 - k) % n, bufs[k % 2]
        for h, a, m in cur:
            h.wait()
            chunks[q][a : a + m] += buf[a : a + m]
            if k + 1 < rounds:
                with meter.at(base + k + 1):
                    sends.append(ops.isend(chunks[q][a : a + m], g, nxt))
        cur = ahead
    for h in sends:
        h.wait()


def ring_all_gather_phase(
    chunks: list[torch.Tensor], g: AxisGroup, meter: Meter, base: int, parts: int
) -> None:
    """In place: starting with ``chunks[r]`` valid on rank r, every rank ends with every
    chunk (N-1 rounds). In round k rank r forwards chunk (r-k) to r+1 and receives
    chunk (r-k-1) from r-1 straight into place, piece by piece (pipelined)."""
    n, r = g.size, g.index
    if n == 1:
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    rounds = n - 1

    def post_recvs(k: int) -> list[tuple[Handle, int, int]]:
        b = (r - k - 1) % n
        with meter.at(base + k):
            return [
                (ops.irecv(chunks[b][a : a + m], g, prv), a, m)
                for a, m in pieces(chunks[b].numel(), parts)
            ]

    sends = _post_sends(chunks[r], parts, g, nxt, meter, base)
    cur = post_recvs(0)
    for k in range(rounds):
        ahead = post_recvs(k + 1) if k + 1 < rounds else []
        b = (r - k - 1) % n
        for h, a, m in cur:
            h.wait()
            if k + 1 < rounds:
                with meter.at(base + k + 1):
                    sends.append(ops.isend(chunks[b][a : a + m], g, nxt))
        cur = ahead
    for h in sends:
        h.wait()
