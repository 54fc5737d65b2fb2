"""Collective algorithms written only with plait's counted point-to-point operations.

For study and for checking the cost model: each all-reduce here returns what
:func:`plait.comm.all_reduce` returns (in place; ``"sum"`` or ``"avg"``; any shape and
size; every rank ends with bit-identical values) and a :class:`Report` holding the
closed-form :class:`~plait.collectives.costs.Cost` and, with ``measure=True``, the traffic
measured from the comm counters of every rank (one extra all-gather, not timed).

========================= =============================================================
``naive``                 rank 0 receives every tensor in turn, sums, sends back in turn
``central``               parameter-server style: all send to a root at once, it sums
                          and sends to all at once
``ring``                  reduce-scatter + all-gather around a ring, pipelined chunks
                          (Patarasuk & Yuan 2009)
``recursive_doubling``    exchange with partner rank XOR 2^k (Thakur, Rabenseifner &
                          Gropp 2005)
``rabenseifner``          reduce-scatter by recursive halving, all-gather by recursive
                          doubling (Rabenseifner 2004; Thakur et al. 2005)
``tree``                  reduce up a binary heap to rank 0, broadcast back down
``direct``                every rank sends its tensor to every other rank at once
========================= =============================================================

Plus :func:`ring_all_gather`, :func:`ring_reduce_scatter` and :func:`direct_all_to_all`.

Non-power-of-two groups (``recursive_doubling``, ``rabenseifner``): with
``fallback=True`` (default) the first 2r ranks (r = N - 2^floor(log2 N)) fold pairwise
first (even rank sends its tensor to the odd one, which adds it), the 2^floor(log2 N)
remaining ranks run the power-of-two algorithm, and the odd ranks send the result back
(2 extra steps, Thakur et al. 2005 section 4); ``fallback=False`` refuses such sizes.

``check_shapes=True`` (default) exchanges every rank's shape and dtype first and raises
on every rank when they differ, instead of hanging in mismatched messages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from plait.collectives.costs import block_start, participant, pow2_floor, tree_height
from plait.collectives.gather import (
    direct_all_to_all,
    ring_all_gather,
    ring_reduce_scatter,
)
from plait.collectives.support import (
    Meter,
    Report,
    check_same_shape,
    exchange_step,
    recv_step,
    ring_all_gather_phase,
    ring_reduce_scatter_phase,
    send_step,
)
from plait.comm import ops
from plait.comm.group import AxisGroup, Handle
from plait.errors import ConfigError

Op = Literal["sum", "avg"]

__all__ = [
    "ALL_REDUCE",
    "Report",
    "all_reduce",
    "all_reduce_central",
    "all_reduce_direct",
    "all_reduce_naive",
    "all_reduce_rabenseifner",
    "all_reduce_recursive_doubling",
    "all_reduce_ring",
    "all_reduce_tree",
    "direct_all_to_all",
    "ring_all_gather",
    "ring_reduce_scatter",
]


def _start(t: torch.Tensor, g: AxisGroup, what: str, op: str, check: bool) -> torch.Tensor:
    """Validate, then return a flat contiguous buffer of ``t`` (a view when possible)."""
    if op not in ("sum", "avg"):
        raise ValueError(f"{what}: reduction {op!r} is not supported; use 'sum' or 'avg'")
    if check:
        check_same_shape(t, g, what)  # before any check that could differ across ranks
    if op == "avg" and not (t.is_floating_point() or t.is_complex()):
        raise ValueError(f"{what}: 'avg' needs a floating-point tensor, got {t.dtype}")
    return t.detach().view(-1) if t.is_contiguous() else t.detach().reshape(-1).clone()


def _finish(
    t: torch.Tensor,
    flat: torch.Tensor,
    g: AxisGroup,
    op: str,
    name: str,
    meter: Meter,
    measure: bool,
) -> Report:
    if op == "avg" and g.size > 1:
        flat.div_(g.size)
    if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
        t.detach().copy_(flat.view(t.shape))
    return meter.report(name, t, measure)


def _wait(handles: list[Handle]) -> None:
    for h in handles:
        h.wait()


def _sum_in_order(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out = parts[0] + parts[1] + ...`` left to right (same bits on every rank)."""
    acc = parts[0].clone()
    for p in parts[1:]:
        acc += p
    out.copy_(acc)


def all_reduce_naive(
    t: torch.Tensor,
    g: AxisGroup,
    op: Op = "sum",
    *,
    check_shapes: bool = True,
    measure: bool = False,
) -> Report:
    """Sequential all-reduce: rank 0 receives from rank 1, 2, ... in turn (adding each),
    then sends the result to rank 1, 2, ... in turn. 2(N-1) steps; rank 0 moves
    (N-1)·S each way."""
    flat = _start(t, g, "all_reduce_naive", op, check_shapes)
    n, i = g.size, g.index
    meter = Meter(g, 2 * (n - 1))
    if n > 1 and i == 0:
        tmp = torch.empty_like(flat)  # (numel,)
        for src in range(1, n):
            recv_step(tmp, g, src, meter, src - 1)
            flat += tmp
        for dst in range(1, n):
            send_step(flat, g, dst, meter, n - 2 + dst)
    elif n > 1:
        send_step(flat, g, 0, meter, i - 1)
        recv_step(flat, g, 0, meter, n - 2 + i)
    return _finish(t, flat, g, op, "naive", meter, measure)


def all_reduce_central(
    t: torch.Tensor,
    g: AxisGroup,
    op: Op = "sum",
    *,
    root: int = 0,
    check_shapes: bool = True,
    measure: bool = False,
) -> Report:
    """Parameter-server style: every rank sends to ``root`` at once; ``root`` sums in
    rank order and sends the result to every rank at once. 2 steps; the root moves
    (N-1)·S each way."""
    if not 0 <= root < g.size:
        raise ValueError(f"all_reduce_central: root {root} outside a group of {g.size}")
    flat = _start(t, g, "all_reduce_central", op, check_shapes)
    n, i = g.size, g.index
    meter = Meter(g, 2)
    if n > 1 and i == root:
        parts = [flat if j == root else torch.empty_like(flat) for j in range(n)]
        with meter.at(0):
            hs = [ops.irecv(parts[j], g, j) for j in range(n) if j != root]
        _wait(hs)
        _sum_in_order(parts, flat)
        with meter.at(1):
            hs = [ops.isend(flat, g, j) for j in range(n) if j != root]
        _wait(hs)
    elif n > 1:
        send_step(flat, g, root, meter, 0)
        recv_step(flat, g, root, meter, 1)
    return _finish(t, flat, g, op, "central", meter, measure)


def all_reduce_ring(
    t: torch.Tensor,
    g: AxisGroup,
    op: Op = "sum",
    *,
    pipeline: int = 4,
    check_shapes: bool = True,
    measure: bool = False,
) -> Report:
    """Ring all-reduce (Patarasuk & Yuan 2009): reduce-scatter in N-1 steps, then
    all-gather in N-1 steps, over N balanced chunks each cut in ``pipeline`` pieces.
    Each rank sends 2(N-1)/N·S bytes (exactly ``2n - c_r - c_{r+1}`` elements)."""
    if pipeline < 1:
        raise ValueError(f"all_reduce_ring: pipeline must be >= 1, got {pipeline}")
    flat = _start(t, g, "all_reduce_ring", op, check_shapes)
    n = g.size
    meter = Meter(g, 2 * (n - 1))
    m = flat.numel()
    chunks = [flat[block_start(c, m, n) : block_start(c + 1, m, n)] for c in range(n)]
    ring_reduce_scatter_phase(chunks, g, meter, 0, pipeline)
    ring_all_gather_phase(chunks, g, meter, n - 1, pipeline)
    return _finish(t, flat, g, op, "ring", meter, measure)


def _fold_check(name: str, n: int, fallback: bool) -> None:
    if not fallback and pow2_floor(n) != n:
        p = pow2_floor(n)
        raise ConfigError(
            f"{name} needs a power-of-two group size without its fallback, got {n}; use "
            f"{p} or {2 * p} ranks, or fallback=True (folds {n - p} rank(s) in: +2 steps)"
        )


def _rank_of(j: int, n: int) -> int:
    """Axis index of participant ``j`` of the power-of-two phase."""
    r = n - pow2_floor(n)
    return 2 * j + 1 if j < r else j + r


def _fold_in(flat: torch.Tensor, g: AxisGroup, meter: Meter) -> None:
    """Pre-step: in the first 2r ranks the even rank hands its tensor to the odd one."""
    i, r = g.index, g.size - pow2_floor(g.size)
    if i >= 2 * r:
        return
    if i % 2 == 0:
        send_step(flat, g, i + 1, meter, 0)
    else:
        tmp = torch.empty_like(flat)
        recv_step(tmp, g, i - 1, meter, 0)
        flat += tmp


def _fold_out(flat: torch.Tensor, g: AxisGroup, meter: Meter, k: int) -> None:
    """Post-step: the odd rank sends the result back to its even partner."""
    i, r = g.index, g.size - pow2_floor(g.size)
    if i >= 2 * r:
        return
    if i % 2:
        send_step(flat, g, i - 1, meter, k)
    else:
        recv_step(flat, g, i + 1, meter, k)


def all_reduce_recursive_doubling(
    t: torch.Tensor,
    g: AxisGroup,
    op: Op = "sum",
    *,
    fallback: bool = True,
    check_shapes: bool = True,
    measure: bool = False,
) -> Report:
    """Recursive doubling (Thakur, Rabenseifner & Gropp 2005): in step k every rank
    exchanges its whole partial sum with partner ``rank XOR 2^k`` and adds; log2 N
    steps of S bytes each way. See the module note for the non-power-of-two fallback."""
    n = g.size
    _fold_check("recursive_doubling", n, fallback)
    flat = _start(t, g, "all_reduce_recursive_doubling", op, check_shapes)
    p, extra = pow2_floor(n), n - pow2_floor(n)
    lg, base = p.bit_length() - 1, (1 if extra else 0)
    meter = Meter(g, lg + 2 * base)
    if extra:
        _fold_in(flat, g, meter)
    j = participant(g.index, n)
    if j is not None:
        tmp = torch.empty_like(flat)  # (numel,)
        for k in range(lg):
            peer = _rank_of(j ^ (1 << k), n)
            with meter.at(base + k):
                hs = [ops.isend(flat, g, peer), ops.irecv(tmp, g, peer)]
            _wait(hs)
            flat += tmp  # a + b == b + a in IEEE arithmetic: partners stay identical
    if extra:
        _fold_out(flat, g, meter, base + lg)
    return _finish(t, flat, g, op, "recursive_doubling", meter, measure)


def all_reduce_rabenseifner(
    t: torch.Tensor,
    g: AxisGroup,
    op: Op = "sum",
    *,
    fallback: bool = True,
    check_shapes: bool = True,
    measure: bool = False,
) -> Report:
    """Rabenseifner's all-reduce (Rabenseifner 2004; Thakur, Rabenseifner & Gropp 2005):
    reduce-scatter by recursive halving (partner at distance p/2, p/4, ..., 1; send
    the half the partner keeps), then all-gather by recursive doubling (distance 1, 2,
    ..., p/2). 2·log2 N steps, 2(N-1)/N·S bytes each way per rank."""
    n = g.size
    _fold_check("rabenseifner", n, fallback)
    flat = _start(t, g, "all_reduce_rabenseifner", op, check_shapes)
    p, extra = pow2_floor(n), n - pow2_floor(n)
    lg, base = p.bit_length() - 1, (1 if extra else 0)
    meter = Meter(g, 2 * lg + 2 * base)
    if extra:
        _fold_in(flat, g, meter)
    j = participant(g.index, n)
    m = flat.numel()

    def span(lo: int, hi: int) -> torch.Tensor:  # elements of blocks [lo, hi)
        return flat[block_start(lo, m, p) : block_start(hi, m, p)]

    if j is not None:
        lo, hi = 0, p
        tmp = torch.empty_like(flat)
        for k in range(lg):  # halving: keep the half that contains block j
            d = p >> (k + 1)
            mid = lo + (hi - lo) // 2
            keep, give = ((mid, hi), (lo, mid)) if j & d else ((lo, mid), (mid, hi))
            mine = span(*keep)
            peer = _rank_of(j ^ d, n)
            with meter.at(base + k):
                hs = [ops.isend(span(*give), g, peer), ops.irecv(tmp[: mine.numel()], g, peer)]
            _wait(hs)
            mine += tmp[: mine.numel()]
            lo, hi = keep
        for k in range(lg):  # doubling: swap whole ranges with the partner
            d = 1 << k
            other = (lo - d, lo) if j & d else (hi, hi + d)
            peer = _rank_of(j ^ d, n)
            with meter.at(base + lg + k):
                hs = [ops.isend(span(lo, hi), g, peer), ops.irecv(span(*other), g, peer)]
            _wait(hs)
            lo, hi = min(lo, other[0]), max(hi, other[1])
    if extra:
        _fold_out(flat, g, meter, base + 2 * lg)
    return _finish(t, flat, g, op, "rabenseifner", meter, measure)


def all_reduce_tree(
    t: torch.Tensor,
    g: AxisGroup,
    op: Op = "sum",
    *,
    check_shapes: bool = True,
    measure: bool = False,
) -> Report:
    """Binary-tree all-reduce: ranks form a heap (children of i: 2i+1, 2i+2); level by
    level, from the deepest, children send their partial sums to their parent, which
    adds them; rank 0 then sends the total back down, level by level. 2·floor(log2 N)
    steps; no rank sends more than 3·S."""
    flat = _start(t, g, "all_reduce_tree", op, check_shapes)
    n, i = g.size, g.index
    h = tree_height(n)
    depth = (i + 1).bit_length() - 1
    meter = Meter(g, 2 * h)
    children = [c for c in (2 * i + 1, 2 * i + 2) if c < n]
    if children:
        bufs = [torch.empty_like(flat) for _ in children]
        with meter.at(h - depth - 1):
            hs = [ops.irecv(b, g, c) for b, c in zip(bufs, children, strict=True)]
        _wait(hs)
        _sum_in_order([flat, *bufs], flat)
    if i > 0:
        send_step(flat, g, (i - 1) // 2, meter, h - depth)
        recv_step(flat, g, (i - 1) // 2, meter, h + depth - 1)
    if children:
        with meter.at(h + depth):
            hs = [ops.isend(flat, g, c) for c in children]
        _wait(hs)
    return _finish(t, flat, g, op, "tree", meter, measure)


def all_reduce_direct(
    t: torch.Tensor,
    g: AxisGroup,
    op: Op = "sum",
    *,
    check_shapes: bool = True,
    measure: bool = False,
) -> Report:
    """Parallel (direct) all-reduce: every rank sends its tensor to every other rank at
    once and sums all N in rank order. One step; N(N-1)·S bytes on the wire."""
    flat = _start(t, g, "all_reduce_direct", op, check_shapes)
    n, i = g.size, g.index
    meter = Meter(g, 1 if n > 1 else 0)
    if n > 1:
        parts = [flat if j == i else torch.empty_like(flat) for j in range(n)]
        exchange_step([flat] * n, parts, g, meter, 0)
        _sum_in_order(parts, flat)
    return _finish(t, flat, g, op, "direct", meter, measure)


ALL_REDUCE: dict[str, Callable[..., Report]] = {
    "naive": all_reduce_naive,
    "central": all_reduce_central,
    "ring": all_reduce_ring,
    "recursive_doubling": all_reduce_recursive_doubling,
    "rabenseifner": all_reduce_rabenseifner,
    "tree": all_reduce_tree,
    "direct": all_reduce_direct,
}
"""Algorithm name -> all-reduce function ``f(t, g, op, **options) -> Report``."""


def all_reduce(
    t: torch.Tensor, g: AxisGroup, algorithm: str = "ring", op: Op = "sum", **options: Any
) -> Report:
    """In place: the all-reduce of ``t`` over ``g`` with the named algorithm."""
    if algorithm not in ALL_REDUCE:
        raise ValueError(
            f"unknown all-reduce algorithm {algorithm!r}; use one of {sorted(ALL_REDUCE)}"
        )
    return ALL_REDUCE[algorithm](t, g, op, **options)
