"""Weighted mixtures of window sets (Megatron's blended datasets), deterministic.

Source ``s`` with weight ``w_s`` (normalised to sum 1) gives its ``k``-th window at the
ideal position ``(k + 0.5) / w_s`` of the blend; the blend is every source's windows
merged by ideal position (ties by source order). So mixture window ``i`` maps to
``(source, k)`` as a pure function of the weights, and every prefix of the blend holds
each source within one window or so of ``w_s`` times its length. The ``k``-th window of
a source is its window ``k mod len(source)`` (a small source repeats, as in Megatron).
The blend has as many windows as the sources together. It is evaluated per window
(:class:`~plait.data.blending.Blend`): nothing per window of the mixture is held.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from plait.data.blending import Blend
from plait.data.dataset import WindowSet
from plait.data.parts import BOTH, Parts, absent
from plait.errors import ConfigError, DataError


def parse_mixture(spec: str) -> list[tuple[str, float]] | None:
    """``"DIR_A:0.7,DIR_B:0.3"`` as ``[(path, weight), ...]``; None when ``spec`` is one
    source without a weight. Weights must be positive numbers."""
    parts = [p.strip() for p in spec.split(",")]
    weighted = []
    for part in parts:
        path, sep, weight = part.rpartition(":")
        try:
            w = float(weight) if sep else None
        except ValueError:
            w = None
        weighted.append((path, w) if w is not None else (part, None))
    if all(w is None for _, w in weighted):  # a path (even one with a comma in it)
        return None
    out = []
    for path, w in weighted:
        if not path or w is None or not w > 0.0 or not np.isfinite(w):
            raise ConfigError(
                f"data.source {spec!r}: a mixture is 'DIR_A:0.7,DIR_B:0.3' (prepared folders, "
                f"positive weights); {path or '?'}:{'' if w is None else w} is not."
            )
        out.append((path, w))
    return out


def blend(weights: Sequence[float], length: int) -> tuple[np.ndarray, np.ndarray]:
    """``(source, k)`` of mixture windows ``0 .. length-1``: two ``(length,)`` int64 arrays
    (:class:`~plait.data.blending.Blend` answers any window without them)."""
    return Blend(weights, length).prefix(length)


class MixtureDataset:
    """Windows of several sets blended by weight (see the module's docstring)."""

    def __init__(self, sets: Sequence[WindowSet], weights: Sequence[float]) -> None:
        if len(sets) != len(weights) or not sets:
            raise ConfigError("a mixture needs one weight per source.")
        seqs = {s.seq_len for s in sets}
        if len(seqs) != 1:
            raise ConfigError(f"the sources of a mixture cut windows of different lengths {seqs}.")
        for i, s in enumerate(sets):
            if len(s) == 0:
                raise DataError(
                    f"source {i} of the mixture has no window of {s.seq_len} + 1 tokens."
                )
        packed = {getattr(s, "efficiency", None) is not None for s in sets}
        if len(packed) != 1:
            raise DataError(
                "a mixture blends packed and unpacked folders; prepare every source with the "
                "same --pack SEQ_LEN, or none with it."
            )
        eos = {s.eos_id for s in sets}
        self.sets = list(sets)
        self.seq_len = sets[0].seq_len
        self.eos_id: int | None = eos.pop() if len(eos) == 1 else None
        self.blend = Blend(weights, sum(len(s) for s in sets))
        """``(source, k)`` of every mixture window, evaluated per window."""

    @property
    def efficiency(self) -> float | None:
        """Real tokens / window tokens of packed sources, weighted by their windows (None
        when the sources are not packed)."""
        total, windows = 0.0, 0
        for s in self.sets:
            eff = getattr(s, "efficiency", None)
            if eff is None:
                return None
            total += float(eff) * len(s)
            windows += len(s)
        return total / windows

    @property
    def num_tokens(self) -> int:
        """Tokens of all sources together."""
        return sum(s.num_tokens for s in self.sets)

    def __len__(self) -> int:
        return self.blend.length

    def locate(self, i: int) -> tuple[int, int]:
        """``(source, window in that source)`` of mixture window ``i``."""
        return self.locate_many([i])[0]

    def locate_many(self, indices: Sequence[int]) -> list[tuple[int, int]]:
        """:meth:`locate` of every index, in order."""
        src, k = self.blend.locate(np.asarray(indices, dtype=np.int64))
        sizes = np.asarray([len(s) for s in self.sets], dtype=np.int64)
        return list(zip(src.tolist(), (k % sizes[src]).tolist(), strict=True))

    def batch(
        self, indices: Sequence[int], parts: Parts = BOTH
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each a ``(len(indices), seq_len)`` LongTensor, in order
        (only ``parts`` read)."""
        if not len(indices):
            empty = torch.empty(0, self.seq_len, dtype=torch.long)
            return empty, empty.clone()
        if not (parts.inputs or parts.targets):
            return absent(len(indices), self.seq_len), absent(len(indices), self.seq_len)
        locs = self.locate_many(indices)
        x = torch.empty(len(locs), self.seq_len, dtype=torch.long)  # (batch, seq)
        y = torch.empty_like(x)
        for s in sorted({s for s, _ in locs}):  # one read per source
            rows = [r for r, (src, _) in enumerate(locs) if src == s]
            sx, sy = self.sets[s].batch([locs[r][1] for r in rows], parts)  # (rows, seq) twice
            x[rows], y[rows] = sx, sy
        n = len(locs)
        return (x if parts.inputs else absent(n, self.seq_len)), (
            y if parts.targets else absent(n, self.seq_len)
        )

    def documents(self, indices: Sequence[int]) -> torch.Tensor | None:
        """The sources' document ids of the windows (None for unpacked sources)."""
        locs = self.locate_many(indices)
        out = torch.empty(len(locs), self.seq_len, dtype=torch.long)  # (batch, seq)
        for s in sorted({s for s, _ in locs}):
            rows = [r for r, (src, _) in enumerate(locs) if src == s]
            docs = self.sets[s].documents([locs[r][1] for r in rows])
            if docs is None:
                return None
            out[rows] = docs
        return out
