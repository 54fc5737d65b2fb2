"""Which keys each block of queries sees, decided on the host once per batch.

Blockwise attention (:mod:`plait.model.blockwise_attention`) and ring attention
(:mod:`plait.parallel.context.ring_attention`) compute a query block against a few key
ranges. Under causal order, document masking (``doc_ids``) and a sliding window
(``window``: query position ``p`` sees keys ``p - window < j <= p``, Hugging Face's
``sliding_window``), query row ``p`` sees the keys of one interval of global positions::

    lo[p] = max(start of p's document, p - window + 1)        (0 when neither applies)
    hi[p] = p                     (causal; else the last key of p's document, or S - 1)

because a document's tokens are contiguous (:func:`~plait.model.document_mask.document_ids`
numbers them in order, so ids never decrease along a row). :func:`classify` turns the
intervals of a block's rows (over the batch) into the kind of one (query block, key
range) pair: ``"skip"`` (no row sees a key of it), ``"full"`` (every row sees every
key: no mask), ``"causal"`` (a diagonal: the kernel's own causal flag) or ``"masked"``
(an additive mask, built on the device from the ids and positions:
:func:`~plait.model.document_mask.visible`). Only the host reads the ids
(:func:`host_ids`: one device-to-host copy per batch, cached on the ids tensor, which
every layer shares), so the kernels run with no ``.item()``, ``.nonzero()`` or
``bool(tensor)`` per block or per ring step, forward or backward.

:func:`blockwise_plan` is the :class:`BlockPlan` of one self-attention: per query
block, the key ranges to visit (one coalesced range for a fused kernel, which tiles
the keys itself; key blocks of ``block`` keys for the reference).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal, TypeVar

import numpy as np
import torch

Kind = Literal["skip", "full", "causal", "masked"]
Spans = tuple[np.ndarray, np.ndarray] | None
T = TypeVar("T")


@dataclass(frozen=True)
class Segment:
    """A key range ``[j0, j1)`` (local indices) a query block visits and how."""

    j0: int
    j1: int
    kind: Kind


@dataclass(frozen=True)
class QueryBlock:
    """Query rows ``[i0, i1)`` and the key ranges they visit, in order."""

    i0: int
    i1: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class BlockPlan:
    """Every query block of one attention call with its key ranges."""

    blocks: tuple[QueryBlock, ...]

    def masked(self) -> bool:
        """Whether any range needs an additive mask."""
        return any(s.kind == "masked" for b in self.blocks for s in b.segments)


_HOST_ATTR = "_plait_host_ids"
_CACHE_ATTR = "_plait_plans"


def cached(doc_ids: torch.Tensor, key: tuple[object, ...], build: Callable[[Spans], T]) -> T:
    """``build(document_spans(host_ids(doc_ids)))``, kept on ``doc_ids`` under ``key``: the
    layers of one forward (and the backward) share the ids tensor, so a plan is built
    once per batch and attention shape."""
    plans: dict[object, Any] | None = getattr(doc_ids, _CACHE_ATTR, None)
    if plans is None:
        plans = {}
        setattr(doc_ids, _CACHE_ATTR, plans)
    if key not in plans:
        if "spans" not in plans:
            plans["spans"] = document_spans(host_ids(doc_ids))
        plans[key] = build(plans["spans"])
    got: T = plans[key]
    return got


def host_ids(doc_ids: torch.Tensor) -> np.ndarray:
    """``doc_ids`` ``(batch, S)`` as an int64 host array, copied from the device once and
    kept on the tensor (every layer and the backward read the same one)."""
    cached = getattr(doc_ids, _HOST_ATTR, None)
    if cached is None:
        cached = doc_ids.detach().to("cpu").numpy().astype(np.int64, copy=False)
        if cached.shape[1] > 1 and (np.diff(cached, axis=1) < 0).any():
            raise ValueError("document ids must not decrease along a sequence")
        setattr(doc_ids, _HOST_ATTR, cached)
    return cached


def document_spans(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(start, end)`` ``(batch, S)``: the first and last position of each token's
    document (ids non-decreasing along each row)."""
    b, s = ids.shape
    idx = np.broadcast_to(np.arange(s), (b, s))
    new = np.ones((b, s), dtype=bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    start = np.maximum.accumulate(np.where(new, idx, 0), axis=1)
    last = np.ones((b, s), dtype=bool)
    last[:, :-1] = new[:, 1:]
    rev = np.where(last, idx, s - 1)[:, ::-1]
    end = np.minimum.accumulate(rev, axis=1)[:, ::-1]
    return start, end


@dataclass(frozen=True)
class Visibility:
    """What decides the keys a query sees: causal order, a window, document ids.

    ``spans`` are :func:`document_spans` of the whole sequence's ids (None: no
    documents); ``length`` is the whole sequence's (keys ``0 .. length-1``)."""

    causal: bool
    window: int | None
    spans: tuple[np.ndarray, np.ndarray] | None
    length: int

    def bounds(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)`` ``(batch or 1, n)``: the first and last key (inclusive, global)
        each query at global positions ``pos`` ``(n,)`` sees."""
        lo = np.zeros((1, len(pos)), dtype=np.int64)
        hi = (pos if self.causal else np.full(len(pos), self.length - 1))[None, :].astype(np.int64)
        if self.window is not None:
            lo = np.maximum(lo, pos[None, :] - self.window + 1)
        if self.spans is not None:
            start, end = self.spans
            lo = np.maximum(lo, start[:, pos])
            hi = np.minimum(hi, end[:, pos])
        return lo, hi

    def trivial(self) -> bool:
        """Whether only causal order (or nothing) masks: no window, no documents."""
        return self.window is None and self.spans is None


def classify(pos: np.ndarray, lo: np.ndarray, hi: np.ndarray, g0: int, g1: int) -> Kind:
    """The kind of the pair (queries at global positions ``pos`` ``(n,)`` with key bounds
    ``lo``/``hi`` ``(batch, n)``, keys ``[g0, g1)`` global)."""
    seen = (lo <= g1 - 1) & (hi >= g0) & (lo <= hi)
    if not seen.any():
        return "skip"
    if (lo <= g0).all() and (hi >= g1 - 1).all():
        return "full"
    n = len(pos)
    diagonal = g1 - g0 == n and bool((pos == g0 + np.arange(n)).all())
    if diagonal and (lo <= g0).all() and (hi == pos[None, :]).all():
        return "causal"
    return "masked"


def _ranges(n: int, block: int) -> list[tuple[int, int]]:
    return [(i, min(i + block, n)) for i in range(0, n, block)]


def _coalesced(
    pos: np.ndarray, lo: np.ndarray, hi: np.ndarray, i0: int, causal: bool
) -> list[Segment]:
    """A fused kernel's ranges: the keys before the block and its diagonal (causal) or
    all its keys, as unmasked ranges where possible, else one masked range."""
    valid = lo <= hi
    if not valid.any():
        return []
    first, last = int(lo[valid].min()), int(hi[valid].max()) + 1
    cuts = [first, max(first, min(i0, last)), last] if causal else [first, last]
    segs = [Segment(a, b, classify(pos, lo, hi, a, b)) for a, b in pairwise(cuts) if b > a]
    segs = [s for s in segs if s.kind != "skip"]
    if any(s.kind == "masked" for s in segs):
        return [Segment(first, last, "masked")]
    return segs


def blockwise_plan(
    sq: int, sk: int, block: int, causal: bool, coalesce: bool, vis: Visibility
) -> BlockPlan:
    """The key ranges of every query block of ``block`` rows (self-attention when
    ``vis`` has a window or documents: ``sq == sk``, positions ``0 .. sq-1``)."""
    blocks = []
    for i0, i1 in _ranges(sq, block):
        pos = np.arange(i0, i1)
        if vis.trivial():
            segs = _plain(i0, i1, sk, block, causal, coalesce)
        elif coalesce:
            segs = _coalesced(pos, *vis.bounds(pos), i0, causal)
        else:
            lo, hi = vis.bounds(pos)
            end = i1 if causal else sk
            segs = [
                Segment(j0, j1, classify(pos, lo, hi, j0, j1)) for j0, j1 in _ranges(end, block)
            ]
            segs = [s for s in segs if s.kind != "skip"]
        blocks.append(QueryBlock(i0, i1, tuple(segs)))
    return BlockPlan(tuple(blocks))


def _plain(i0: int, i1: int, sk: int, block: int, causal: bool, coalesce: bool) -> list[Segment]:
    """Ranges under causal order alone (or no mask): no host data needed."""
    if not causal:
        return (
            [Segment(0, sk, "full")]
            if coalesce
            else [Segment(a, b, "full") for a, b in _ranges(sk, block)]
        )
    if coalesce:
        return ([Segment(0, i0, "full")] if i0 else []) + [Segment(i0, i1, "causal")]
    return [
        Segment(j0, min(j1, i1), "causal" if min(j1, i1) > i0 + 1 else "full")
        for j0, j1 in _ranges(i1, block)
    ]
