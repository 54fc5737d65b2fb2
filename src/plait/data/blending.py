"""The blend of a mixture (Megatron's blended datasets), evaluated per position.

Source ``s`` with weight ``w_s`` (normalised to sum 1) gives its ``k``-th window at the
ideal time ``t(s, k) = (k + 0.5) / w_s``; the blend of ``length`` positions is every
source's windows merged by time (ties by source order), source ``s`` offering its first
``ceil(length · w_s) + 1`` windows. :class:`Blend` answers ``(source, k)`` of any
position without building the merge: time is cut into blocks of :data:`BLOCK` units;
how many windows of a source come before a time is a closed form (``ceil(T·w_s − 0.5)``,
corrected against the same floating-point times the merge compares), so a block's first
position is a sum over the sources and a block's windows are merged on their own (at most
``BLOCK`` of them, plus one per source). Memory is a block per position asked, whatever
the length; the answers equal the whole merge's exactly (:func:`merged_blend`, the
reference, builds it: small lengths only).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BLOCK = 64
"""Time units per block: about that many positions are merged to answer one."""
CHUNK = 4096
"""Positions located at once (memory: about ``CHUNK x (BLOCK + 2S)`` int64 twice)."""


def normalised(weights: Sequence[float]) -> np.ndarray:
    """``(S,)`` float64 weights summing to 1."""
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


def merged_blend(weights: Sequence[float], length: int) -> tuple[np.ndarray, np.ndarray]:
    """``(source, k)`` of positions ``0 .. length-1``, two ``(length,)`` int64 arrays, by
    merging every source's windows at once (memory grows with ``length``)."""
    w = normalised(weights)
    times, srcs, ks = [], [], []
    for s, ws in enumerate(w):
        n = int(np.ceil(length * ws)) + 1
        k = np.arange(n, dtype=np.int64)
        times.append((k + 0.5) / ws)
        srcs.append(np.full(n, s, dtype=np.int64))
        ks.append(k)
    t, src, kk = np.concatenate(times), np.concatenate(srcs), np.concatenate(ks)
    order = np.lexsort((src, t))[:length]  # by time, then source
    return src[order], kk[order]


class Blend:
    """``(source, k)`` of the positions of a blend (see the module's docstring)."""

    def __init__(self, weights: Sequence[float], length: int) -> None:
        self.w = normalised(weights)  # (S,)
        self.length = length
        self.caps = np.ceil(length * self.w).astype(np.int64) + 1  # (S,) windows offered

    def _time(self, k: np.ndarray) -> np.ndarray:
        """Times of windows ``k[..., s]`` of every source ``s`` (the merge's floats)."""
        return (k + 0.5) / self.w

    def before(self, times: np.ndarray) -> np.ndarray:
        """``(n, S)`` int64: windows of each source whose time is below ``times[i]``."""
        t = np.asarray(times, dtype=np.float64)[:, None]  # (n, 1)
        c = np.clip(np.ceil(t * self.w - 0.5), 0, self.caps).astype(np.int64)  # (n, S)
        while True:  # the closed form may be one off where the floats round
            down = (c > 0) & (self._time(c - 1) >= t)
            up = (c < self.caps) & (self._time(c) < t)
            if not (down.any() or up.any()):
                return c
            c = c - down + up

    def starts(self, blocks: np.ndarray) -> np.ndarray:
        """``(n,)`` int64 first positions of time blocks ``blocks``."""
        return self.before(np.asarray(blocks, dtype=np.float64) * BLOCK).sum(axis=1)

    def start(self, block: int) -> int:
        """The first position of time block ``block``."""
        return int(self.starts(np.asarray([block]))[0])

    def block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source, k)`` of block ``block``'s positions in order, ``(b,)`` int64 each."""
        lo, hi = self.before(np.asarray([block, block + 1], dtype=np.float64) * BLOCK)
        src = np.repeat(np.arange(len(self.w), dtype=np.int64), hi - lo)
        k = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in zip(lo, hi, strict=True)])
        order = np.lexsort((src, (k + 0.5) / self.w[src]))  # by time, then source
        return src[order], k[order]

    def prefix(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source, k)`` of positions ``0 .. n-1`` (``n <= length``), a block at a time."""
        if not 0 <= n <= self.length:
            raise IndexError(f"a prefix of {n} positions of a blend of {self.length}")
        srcs, ks, have, j = [], [], 0, 0
        while have < n:
            bs, bk = self.block(j)
            srcs.append(bs)
            ks.append(bk)
            have, j = have + len(bs), j + 1
        src = np.concatenate(srcs)[:n] if srcs else np.zeros(0, dtype=np.int64)
        k = np.concatenate(ks)[:n] if ks else np.zeros(0, dtype=np.int64)
        return src, k

    def locate(self, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, k)`` of ``positions`` (each in ``[0, length)``), ``(n,)`` int64 each,
        :data:`CHUNK` positions at a time."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if pos.size and (pos.min() < 0 or pos.max() >= self.length):
            raise IndexError(f"positions outside a blend of {self.length}")
        parts = [self._locate(pos[a : a + CHUNK]) for a in range(0, len(pos), CHUNK)]
        if not parts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _locate(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`locate` of ``(n,)`` positions, vectorised: each position's block, then its
        rank among the block's windows sorted by (time, source)."""
        j = pos // BLOCK  # (n,) a guess: a block starts within S/2 of j·BLOCK
        while (back := (j > 0) & (self.starts(j) > pos)).any():
            j = j - back
        while (ahead := self.starts(j + 1) <= pos).any():
            j = j + ahead
        lo = self.before(j * float(BLOCK))  # (n, S)
        hi = self.before((j + 1) * float(BLOCK))
        rank = pos - lo.sum(axis=1)  # (n,) the position's place in its block
        width = (hi - lo).max(axis=0)  # (S,) candidate columns per source
        src_col = np.repeat(np.arange(len(self.w), dtype=np.int64), width)  # (C,)
        offset = np.concatenate([np.arange(m, dtype=np.int64) for m in width])  # (C,)
        k = lo[:, src_col] + offset  # (n, C) candidate windows
        times = np.where(k < hi[:, src_col], (k + 0.5) / self.w[src_col], np.inf)
        order = np.argsort(times, axis=1, kind="stable")  # ties: source order (columns)
        col = order[np.arange(len(pos)), rank]  # (n,)
        return src_col[col], k[np.arange(len(pos)), col]
