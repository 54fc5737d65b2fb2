"""Closed-form traffic of the point-to-point collective algorithms in
:mod:`plait.collectives.algorithms` (pure arithmetic: no process group needed).

Notation: N ranks, a tensor of ``n`` elements of ``e`` bytes (S = n·e bytes). Tensors
are split into balanced blocks: block i of ``n`` over ``k`` blocks holds
``n // k + (1 if i < n % k else 0)`` elements (the first ``n % k`` blocks are larger).

A :class:`Cost` gives the number of communication *steps* (rounds of the schedule in
which at least one message moves), the bytes each rank sends and receives, and the
*critical-path bytes*: the sum over rounds of the most bytes one rank sends or
receives in that round (full-duplex links, one port per direction). The alpha-beta
model of an algorithm is ``time = steps·alpha + critical_bytes·beta``
(Hockney 1994; Thakur, Rabenseifner & Gropp 2005).

=================== =========== ======================= ======================
all-reduce          steps       peak bytes sent (rank)  total bytes on wire
=================== =========== ======================= ======================
naive (sequential)  2(N-1)      (N-1)·S  (rank 0)       2(N-1)·S
central (PS)        2           (N-1)·S  (root)         2(N-1)·S
ring                2(N-1)      2(N-1)/N·S              2(N-1)·S
recursive doubling  log2 N      log2 N·S                N·log2 N·S
rabenseifner        2·log2 N    2(N-1)/N·S              2(N-1)·S
tree (binary heap)  2·floor(log2 N)  3·S (inner node)   2(N-1)·S
direct (parallel)   1           (N-1)·S                 N(N-1)·S
=================== =========== ======================= ======================

(Ring and Rabenseifner figures are for n divisible by N; recursive doubling and
Rabenseifner for N a power of two. Otherwise the exact functions below apply.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    """Traffic of one collective call: closed form or measured from the counters."""

    algorithm: str
    world: int
    nbytes: int
    """S: bytes of the tensor the collective is about (the input of one rank)."""
    steps: int
    sent: tuple[int, ...]
    """Bytes sent by each rank, in axis order."""
    received: tuple[int, ...]
    """Bytes received by each rank, in axis order."""
    critical_bytes: int
    """Sum over rounds of the most bytes one rank sends or receives in the round."""

    @property
    def peak_sent(self) -> int:
        """The most bytes any single rank sends."""
        return max(self.sent, default=0)

    @property
    def total_bytes(self) -> int:
        """Bytes on the wire (every message counted once)."""
        return sum(self.sent)

    def predict(self, alpha: float, beta: float) -> float:
        """Alpha-beta time: ``steps·alpha + critical_bytes·beta`` (seconds)."""
        return self.steps * alpha + self.critical_bytes * beta


def block(i: int, n: int, k: int) -> int:
    """Elements of block ``i`` when ``n`` elements are split into ``k`` balanced blocks."""
    return n // k + (1 if i < n % k else 0)


def block_start(i: int, n: int, k: int) -> int:
    """First element of block ``i`` (the sum of the sizes of blocks ``0..i-1``)."""
    return i * (n // k) + min(i, n % k)


def pow2_floor(n: int) -> int:
    """The largest power of two that is <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def _uniform(name: str, world: int, nbytes: int, steps: int, per_rank: int) -> Cost:
    t = tuple([per_rank] * world)
    return Cost(name, world, nbytes, steps, t, t, steps and per_rank)


def naive(world: int, n: int, e: int) -> Cost:
    """Rank 0 receives every tensor in turn, then sends the sum to each rank in turn."""
    s, m = n * e, world - 1
    sent = tuple([m * s] + [s] * m)
    return Cost("naive", world, s, 2 * m, sent, sent, 2 * m * s)


def central(world: int, n: int, e: int, root: int = 0) -> Cost:
    """Every rank sends to ``root`` at once; ``root`` sums and sends to all at once."""
    s, m = n * e, world - 1
    sent = tuple(m * s if i == root else s for i in range(world))
    return Cost("central", world, s, 2 if m else 0, sent, sent, 2 * m * s)


def ring(world: int, n: int, e: int) -> Cost:
    """Reduce-scatter then all-gather around the ring (Patarasuk & Yuan 2009).

    Rank r sends every block but r in the reduce-scatter and every block but r+1 in the
    all-gather: ``sent_r = (2n - c_r - c_{r+1})·e``; it receives what rank r-1 sends.
    """
    if world == 1:
        return _uniform("ring", 1, n * e, 0, 0)
    c = [block(i, n, world) for i in range(world)]
    sent = tuple((2 * n - c[r] - c[(r + 1) % world]) * e for r in range(world))
    recv = tuple(sent[(r - 1) % world] for r in range(world))
    return Cost("ring", world, n * e, 2 * (world - 1), sent, recv, 2 * (world - 1) * c[0] * e)


def _fold(world: int) -> tuple[int, int]:
    """(p, r): the power of two p <= N taking part, and the r = N - p ranks folded in."""
    p = pow2_floor(world)
    return p, world - p


def participant(rank: int, world: int) -> int | None:
    """The index among the p = 2^floor(log2 N) participants of the power-of-two phase
    (None for the even ranks below 2r that hand their data to rank+1 first)."""
    _, r = _fold(world)
    if rank < 2 * r:
        return rank // 2 if rank % 2 else None
    return rank - r


def recursive_doubling(world: int, n: int, e: int) -> Cost:
    """Exchange the whole vector with partner ``j XOR 2^k`` for k < log2 p.

    For N not a power of two the first 2r ranks fold pairwise first (even sends to odd)
    and the result is sent back at the end: 2 more steps (Thakur et al. 2005, sec. 4).
    """
    s = n * e
    p, r = _fold(world)
    lg = p.bit_length() - 1
    per = _folded_bytes(world, s, lambda j: lg * s)  # sent = received
    steps = lg + (2 if r else 0)
    return Cost("recursive_doubling", world, s, steps, per, per, steps * s)


def _folded_bytes(world: int, s: int, moved: Callable[[int], int]) -> tuple[int, ...]:
    """Bytes each rank sends (and receives) in a power-of-two algorithm with the fold:
    ``moved(j)`` for participant j, plus S for each of the first 2r ranks (the fold
    message in and the result out)."""
    _, r = _fold(world)
    out = []
    for rank in range(world):
        j = participant(rank, world)
        out.append((moved(j) if j is not None else 0) + (s if rank < 2 * r else 0))
    return tuple(out)


def _aligned(j: int, size: int, n: int, p: int) -> int:
    """Elements in the aligned range of ``size`` blocks (out of p) that contains block j."""
    start = (j // size) * size
    return block_start(start + size, n, p) - block_start(start, n, p)


def rabenseifner(world: int, n: int, e: int) -> Cost:
    """Reduce-scatter by recursive halving, all-gather by recursive doubling
    (Rabenseifner 2004; Thakur, Rabenseifner & Gropp 2005), with the same fold as
    :func:`recursive_doubling` for N not a power of two.

    Participant j ends the halving owning block j; at halving step k it keeps the
    aligned range of p/2^(k+1) blocks containing j and sends the other half, so it
    sends ``n - c_j`` elements and receives ``sum_k |R_k(j)|`` in the halving, and the
    reverse in the doubling.
    """
    s = n * e
    p, r = _fold(world)
    lg = p.bit_length() - 1

    def moved(j: int) -> int:  # halving sends n - c_j, receives the kept ranges; doubling back
        kept = sum(_aligned(j, p >> k, n, p) for k in range(1, lg + 1))
        return (n - block(j, n, p) + kept) * e

    per = _folded_bytes(world, s, moved)  # sent = received
    # the largest half moved in halving step k is the first aligned range of p/2^(k+1)
    halves = sum(block_start(p >> (k + 1), n, p) for k in range(lg)) * e
    steps = 2 * lg + (2 if r else 0)
    crit = 2 * halves + (2 * s if r else 0)
    return Cost("rabenseifner", world, s, steps, per, per, crit)


def tree_height(world: int) -> int:
    """Height of the binary heap of N nodes (children of i: 2i+1, 2i+2)."""
    return (world).bit_length() - 1


def tree(world: int, n: int, e: int) -> Cost:
    """Reduce up a binary heap to rank 0 (one round per level), then broadcast down.

    Rank i sends S to its parent and S to each child; the critical path moves
    ``min(2, nodes at depth l)·S`` per level and direction.
    """
    s = n * e
    h = tree_height(world)
    sent = []
    for i in range(world):
        children = sum(1 for c in (2 * i + 1, 2 * i + 2) if c < world)
        sent.append((children + (1 if i else 0)) * s)
    per_level = [min(2, min(world, 2 ** (lv + 1) - 1) - (2**lv - 1)) for lv in range(1, h + 1)]
    return Cost("tree", world, s, 2 * h, tuple(sent), tuple(sent), 2 * s * sum(per_level))


def direct(world: int, n: int, e: int) -> Cost:
    """Every rank sends its whole tensor to every other rank at once, then sums."""
    s = n * e
    return _uniform("direct", world, s, 1 if world > 1 else 0, (world - 1) * s)


def ring_all_gather(world: int, n: int, e: int) -> Cost:
    """Ring all-gather of one ``n``-element piece per rank: N-1 steps of n·e bytes."""
    s = n * e
    return _uniform("ring_all_gather", world, s, world - 1, (world - 1) * s)


def ring_reduce_scatter(world: int, n: int, e: int) -> Cost:
    """Ring reduce-scatter of an ``n``-element input (n divisible by N): N-1 steps."""
    s = n * e
    return _uniform("ring_reduce_scatter", world, s, world - 1, (world - 1) * s // world)


def direct_all_to_all(world: int, n: int, e: int) -> Cost:
    """Direct all-to-all of an ``n``-element input (n divisible by N): one step."""
    s = n * e
    return _uniform("direct_all_to_all", world, s, 1 if world > 1 else 0, (world - 1) * s // world)


FORMULAS: dict[str, Callable[[int, int, int], Cost]] = {
    "naive": naive,
    "central": central,
    "ring": ring,
    "recursive_doubling": recursive_doubling,
    "rabenseifner": rabenseifner,
    "tree": tree,
    "direct": direct,
    "ring_all_gather": ring_all_gather,
    "ring_reduce_scatter": ring_reduce_scatter,
    "direct_all_to_all": direct_all_to_all,
}
"""Algorithm name -> ``f(world, numel, element_size)`` giving its closed-form :class:`Cost`."""


ASYMPTOTICS: dict[str, tuple[str, str, str]] = {
    "naive": ("O(N)", "O(N)", "O(N)"),
    "central": ("O(1)", "O(N)", "O(N)"),
    "ring": ("O(N)", "O(1)", "O(N)"),
    "recursive_doubling": ("log2 N", "O(log N)", "O(N log N)"),
    "rabenseifner": ("2 log2 N", "O(1)", "O(N)"),
    "tree": ("2 log2 N", "O(1)", "O(N)"),
    "direct": ("O(1)", "O(N)", "O(N^2)"),
}
"""All-reduce name -> (steps, peak bytes one rank sends, total bytes) as N grows, S fixed
(the table in docs/collectives.md; the rows for rabenseifner and tree are the textbook ones)."""


def traffic_table(rows: list[Cost], checked: dict[str, bool] | None = None) -> str:
    """Markdown table of steps and bytes (in units of S) of ``rows``, one per
    (algorithm, N), with the asymptotic class of each all-reduce beside it.
    ``checked`` (algorithm -> bool), when given, adds a "counters = formula" column."""
    head = (
        "| algorithm | N | steps | sent per rank (×S) | peak sent (×S) | total on wire (×S) "
        "| critical path (×S) | asymptotics: steps / peak / total |"
    )
    sep = "|---|---:|---:|---:|---:|---:|---:|---|"
    if checked is not None:
        head, sep = head + " counters = formula |", sep + ":---:|"
    lines = [head, sep]
    for c in rows:
        s = c.nbytes or 1
        lo, hi = min(c.sent, default=0) / s, max(c.sent, default=0) / s
        per = f"{lo:.4g}" if lo == hi else f"{lo:.4g} .. {hi:.4g}"
        asym = " / ".join(ASYMPTOTICS.get(c.algorithm, ("", "", ""))) or "-"
        line = (
            f"| {c.algorithm} | {c.world} | {c.steps} | {per} | {c.peak_sent / s:.4g} | "
            f"{c.total_bytes / s:.4g} | {c.critical_bytes / s:.4g} | {asym} |"
        )
        if checked is not None:
            line += f" {'yes' if checked.get(c.algorithm, False) else 'NO'} |"
        lines.append(line)
    return "\n".join(lines)


def formula(algorithm: str, world: int, numel: int, element_size: int) -> Cost:
    """The closed-form :class:`Cost` of ``algorithm`` (see :data:`FORMULAS`)."""
    if algorithm not in FORMULAS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {sorted(FORMULAS)}")
    if world < 1 or numel < 0 or element_size < 1:
        raise ValueError(f"bad sizes: world={world}, numel={numel}, element_size={element_size}")
    return FORMULAS[algorithm](world, numel, element_size)
