"""Communication time in the alpha-beta model, per algorithm and per link class.

A message of S bytes over a link costs ``alpha + S/B`` (Hockney 1994). Collective
algorithms over N ranks (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective
Communication Operations in MPICH"; Patarasuk & Yuan 2009 for the ring):

==================  ===========================================  =================
all-reduce          time                                         bytes sent / rank
==================  ===========================================  =================
ring                2(N-1)·alpha + 2(N-1)/N · S/B                 2(N-1)/N · S
tree (pipelined)    2·ceil(log2 N)·alpha + 2·S/B                  2·S (inner nodes)
recursive doubling  ceil(log2 N)·(alpha + S/B)                    log2 N · S
==================  ===========================================  =================

All-gather and reduce-scatter (ring): ``(N-1)·alpha + (N-1)/N · S/B`` with S the full
(gathered, or pre-scatter) tensor; all-to-all the same; point-to-point ``alpha + S/B``.
"tree" here is NCCL's pipelined (double binary) tree, whose bandwidth term does not grow
with depth; it is not the unpipelined binary tree of :mod:`plait.collectives.algorithms`
(inner nodes send 3·S per step, costed in :mod:`plait.collectives.costs`).
``auto`` takes the fastest of ring and tree, as NCCL does — unless the link carries a
measurement of the operation on a group of that size covering the message size
(:attr:`plait.plan.hardware.Link.measured`, written by calibration), which is then
interpolated instead.

Where a group sits decides its link. Ranks are laid out like :class:`plait.mesh.MeshLayout`
(``pp, dp, cp, tp``, tp fastest), so a group whose members lie within one node's range
of ranks uses the intra-node link and any other group is limited by the slowest link it
crosses, the inter-node one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from plait.errors import ConfigError
from plait.plan.hardware import IN_STEP, Hardware, Link
from plait.plan.layout import Layout

Algorithm = Literal["auto", "ring", "tree", "recursive_doubling"]
ALGORITHMS: tuple[Algorithm, ...] = ("auto", "ring", "tree", "recursive_doubling")


def ring_bytes_per_rank(nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: 2(N-1)/N · S."""
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n * nbytes


def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def all_reduce_time(nbytes: float, n: int, link: Link, algorithm: Algorithm = "auto") -> float:
    """Seconds for an all-reduce of ``nbytes`` over ``n`` ranks on ``link``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if algorithm == "auto":  # the library's own choice is what a profile measured
        seen = link.measured_seconds("all_reduce", n, nbytes)
        if seen is not None:
            return seen
    alpha, bw = link.fit("all_reduce")
    ring = 2 * (n - 1) * alpha + ring_bytes_per_rank(nbytes, n) / bw
    tree = 2 * _log2(n) * alpha + 2.0 * nbytes / bw
    if algorithm == "ring":
        return ring
    if algorithm == "tree":
        return tree
    if algorithm == "recursive_doubling":
        return _log2(n) * (alpha + nbytes / bw)
    if algorithm == "auto":
        return min(ring, tree)
    raise ConfigError(f"unknown all-reduce algorithm {algorithm!r}; use one of {ALGORITHMS}.")


def in_step_all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Seconds one synchronous all-reduce adds to a step when issued between compute, as
    tensor parallelism issues it: the profile's in-step measurement where it has one for
    this group size and message (it includes waiting for the slower peer), else
    :func:`all_reduce_time`."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    seen = link.measured_seconds(IN_STEP, n, nbytes)
    return seen if seen is not None else all_reduce_time(nbytes, n, link)


def _ring_half(op: str, nbytes: float, n: int, link: Link) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    seen = link.measured_seconds(op, n, nbytes)
    if seen is not None:
        return seen
    alpha, bw = link.fit(op)
    return (n - 1) * alpha + (n - 1) / n * nbytes / bw


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather; ``nbytes`` is the gathered (output) size."""
    return _ring_half("all_gather", nbytes, n, link)


def reduce_scatter_time(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter; ``nbytes`` is the input size (before scattering)."""
    return _ring_half("reduce_scatter", nbytes, n, link)


def all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    """Pairwise all-to-all; ``nbytes`` is each rank's input."""
    return _ring_half("all_to_all", nbytes, n, link)


def p2p_time(nbytes: float, link: Link) -> float:
    """One point-to-point message."""
    if nbytes <= 0:
        return 0.0
    seen = link.measured_seconds("p2p", 2, nbytes)
    if seen is not None:
        return seen
    alpha, bw = link.fit("p2p")
    return alpha + nbytes / bw


# ------------------------------------------------------------------ group placement


@dataclass(frozen=True)
class Group:
    """A communication group of the layout: its size and the link that bounds it."""

    name: str
    """Which axes, e.g. ``tp`` or ``dp+cp``."""
    size: int
    """Ranks in the group."""
    span: int
    """Consecutive global ranks the group's members lie within (stride x size)."""
    link: Link
    """The slowest link the group crosses."""
    crosses_nodes: bool
    """Whether members sit on different nodes."""


_STRIDE_ORDER = ("tp", "cp", "dp", "pp")  # fastest-varying first (plait.mesh order)


def _strides(layout: Layout) -> dict[str, int]:
    out, stride = {}, 1
    for axis in _STRIDE_ORDER:
        out[axis] = stride
        stride *= getattr(layout, axis)
    return out


def group(layout: Layout, hw: Hardware, axis: str, size: int | None = None, step: int = 1) -> Group:
    """The group along ``axis`` (``tp``, ``cp``, ``dp``, ``pp``, or ``dp+cp``).

    ``size`` and ``step`` select a sub-group of the axis: ``size`` members ``step``
    positions apart (ZeRO's shard groups of F consecutive dp ranks have step 1; its
    replica groups step F).
    """
    strides = _strides(layout)
    if axis == "dp+cp":  # contiguous over cp then dp: stride tp, dp*cp members
        n = layout.dp * layout.cp
        span = layout.tp * n
    else:
        n = getattr(layout, axis) if size is None else size
        span = strides[axis] * step * (n - 1) + 1 if n > 1 else 1
    crosses = span > hw.devices_per_node and layout.world > hw.devices_per_node
    return Group(axis, n, span, hw.inter if crosses else hw.intra, crosses)
