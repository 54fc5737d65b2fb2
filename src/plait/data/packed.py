"""Windows of a packed folder (``plait data prepare --pack SEQ_LEN``), memory-mapped.

The folder's stream is whole windows of ``seq_len + 1`` tokens, each holding whole
samples and a padding tail (:mod:`plait.data.sample_prepare`); window ``w`` is tokens
``[w·(seq_len+1), (w+1)·(seq_len+1))``. Inputs are its first ``seq_len`` tokens, targets
its last ``seq_len``; a target whose mask byte is 0 (a prompt token, a sample's first
token, padding) is the loss's ignore index, so no target crosses a sample boundary.

The held-out windows are chosen by a hash of the window number
(:func:`~plait.data.shards.held_out`), and a set is a list of runs of consecutive
windows, as :class:`~plait.data.shards.SegmentDataset`'s: nothing per window is held in
memory. :meth:`PackedDataset.documents` gives each input token's document (sample) number
within its window, from the memory-mapped ``documents.bin`` (the samples and padding runs),
for document masking and positions restarting at each sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from plait.data.parts import BOTH, Parts, split_window
from plait.data.shards import ShardStream, held_out, ignore_untrained, mask_stream, runs
from plait.errors import DataError


class PackedDataset:
    """The packed windows in runs ``[starts[k], stops[k])`` of window numbers."""

    def __init__(self, stream: ShardStream, starts: np.ndarray, stops: np.ndarray) -> None:
        packed = stream.index.packed
        assert packed is not None
        self.stream = stream
        self.masks = mask_stream(stream)
        self.seq_len = int(packed["seq_len"])
        self.width = self.seq_len + 1  # tokens per window
        self.eos_id: int | None = stream.index.eos_id
        self.efficiency = stream.index.packing_efficiency
        """Real tokens / window tokens of the whole folder."""
        self.run_start = np.asarray(starts, dtype=np.int64)  # (n_runs,) first window of a run
        lengths = np.asarray(stops, dtype=np.int64) - self.run_start
        self.virtual = np.concatenate([[0], np.cumsum(lengths)])  # (n_runs + 1,)
        self._ends: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.virtual[-1])

    @property
    def num_tokens(self) -> int:
        """Window tokens of the set (padding included)."""
        return len(self) * self.width

    def window_number(self, i: int) -> int:
        """The folder's window number of this set's window ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a dataset of {len(self)} samples")
        k = int(np.searchsorted(self.virtual, i, side="right")) - 1
        return int(self.run_start[k] + i - self.virtual[k])

    def _rows(
        self, stream: ShardStream, indices: Sequence[int], span: tuple[int, int]
    ) -> np.ndarray:
        """``(len(indices), hi - lo)`` values of ``stream``: tokens ``span = (lo, hi)`` of
        each window."""
        lo, hi = span
        starts = [self.window_number(int(i)) * self.width for i in indices]
        if hi == lo:
            return np.zeros((len(starts), 0), dtype=stream.dtype)
        return np.stack([stream.read(a + lo, a + hi) for a in starts])

    def batch(
        self, indices: Sequence[int], parts: Parts = BOTH
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each ``(len(indices), seq_len)``; untrained targets are
        the ignore index (only ``parts`` read)."""
        if not len(indices):
            empty = torch.empty(0, self.seq_len, dtype=torch.long)
            return empty, empty.clone()
        span = parts.span(self.seq_len)
        w = torch.from_numpy(self._rows(self.stream, indices, span).astype(np.int64))
        x, y = split_window(w, parts, self.seq_len)
        if self.masks is None or not parts.targets:
            return x, y
        return x, ignore_untrained(y, self._rows(self.masks, indices, (1, self.width)))

    def documents(self, indices: Sequence[int]) -> torch.Tensor:
        """``(len(indices), seq_len)`` int64: the sample number (0, 1, ... within its window;
        the padding tail one more) of every input token."""
        if self._ends is None:
            self._ends = self.stream.document_ends()  # (n_docs,) uint64, memory-mapped
        ends = self._ends
        out = torch.empty(len(indices), self.seq_len, dtype=torch.long)
        pos = np.arange(self.seq_len, dtype=np.uint64)  # (seq,)
        for r, i in enumerate(indices):
            base = np.uint64(self.window_number(int(i)) * self.width)
            first = np.searchsorted(ends, base, side="right")
            doc = np.searchsorted(ends, base + pos, side="right") - first  # (seq,)
            out[r] = torch.from_numpy(doc.astype(np.int64))
        return out


def open_packed(
    stream: ShardStream, seq_len: int, val_fraction: float | None
) -> tuple[PackedDataset, PackedDataset | None]:
    """``(train, val)`` of a packed folder: with ``val_fraction`` the held-out windows are the
    validation set; with None every window trains (val None). ``seq_len`` must be the
    packing's."""
    packed = stream.index.packed
    assert packed is not None
    if int(packed["seq_len"]) != seq_len:
        raise DataError(
            f"{stream.index.root} is packed into windows of {packed['seq_len']} + 1 tokens but "
            f"train.seq_len is {seq_len}; train with train.seq_len {packed['seq_len']} or "
            f"prepare again with --pack {seq_len}."
        )
    n = int(packed["windows"])
    if n * (seq_len + 1) != len(stream):
        raise DataError(f"{stream.index.root}: the packed windows do not match the shards.")
    if val_fraction is None:
        whole = np.asarray([0], dtype=np.int64), np.asarray([n], dtype=np.int64)
        return PackedDataset(stream, *whole), None
    val = held_out(n, val_fraction)
    sets = []
    for keep in (~val, val):
        a, b = runs(keep)
        sets.append(PackedDataset(stream, a, b))
    return sets[0], sets[1]
