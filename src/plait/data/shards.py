"""Windows over a prepared folder, read from memory-mapped shards without loading them.

:class:`ShardStream` is the folder's token stream (the shards in order, one
read-only memory map each, opened on first use); a read may span shards and drops the
pages it touched from the process's mapping afterwards, so resident memory stays at a
few windows whatever the data's size. The documents are split
once into training and held-out (validation) documents by a hash of their number
(:func:`held_out`), so the split does not depend on the order of reading, the layout or
the seed. :class:`SegmentDataset` cuts non-overlapping windows of ``seq_len + 1`` tokens
(the last shared with the next window, as :class:`~plait.data.dataset.TokenDataset`) from
a list of token ranges of the stream: the runs of consecutive training documents, or of
held-out ones. Only the pages of the windows read come into memory.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from plait.data.index import ShardIndex, read_index
from plait.data.parts import BOTH, Parts, split_window
from plait.data.read_count import READ
from plait.errors import ConfigError, DataError

_MASK64 = np.uint64((1 << 64) - 1)


class ShardStream:
    """The token stream of a prepared folder: ``read(a, b)`` is tokens ``[a, b)`` (or, with
    ``files`` and ``dtype``, another stream beside it: the loss mask's ``mask_*.bin``)."""

    def __init__(
        self,
        index: ShardIndex,
        files: list[dict[str, Any]] | None = None,
        dtype: str | None = None,
    ) -> None:
        self.index = index
        self.files = index.shards if files is None else files
        self.dtype = np.dtype(dtype or index.dtype)
        sizes = np.asarray([int(s["tokens"]) for s in self.files], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])  # (n_shards + 1,)
        self._maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _shard(self, i: int) -> tuple[mmap.mmap, np.ndarray]:
        m = self._maps.get(i)
        if m is None:
            path = self.index.root / str(self.files[i]["file"])
            with path.open("rb") as f:  # the map keeps its own handle
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            m = mm, np.frombuffer(mm, dtype=self.dtype)  # (shard_tokens,), read-only view
            self._maps[i] = m
        return m

    def _copy(self, i: int, lo: int, hi: int) -> np.ndarray:
        """Tokens ``[lo, hi)`` of shard ``i``, copied; the pages read are then dropped
        from this process's mapping (``MADV_DONTNEED``; they stay in the page cache),
        since the kernel may map a whole large folio (up to MiBs) per fault."""
        mm, arr = self._shard(i)
        out = np.array(arr[lo:hi])
        READ.add(out.nbytes)
        if hasattr(mmap, "MADV_DONTNEED"):
            item = self.dtype.itemsize
            start = lo * item // mmap.PAGESIZE * mmap.PAGESIZE
            mm.madvise(mmap.MADV_DONTNEED, start, hi * item - start)
        return out

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream, copied out of the maps, ``(stop - start,)``."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"tokens [{start}, {stop}) outside a stream of {len(self)}")
        parts = []
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.starts[i + 1]))
            base = int(self.starts[i])
            parts.append(self._copy(i, start - base, end - base))
            start, i = end, i + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def document_ends(self) -> np.ndarray:
        """End offsets of the documents, ``(n_docs,)`` uint64 (memory-mapped)."""
        path = self.index.root / str(self.index.document_ends["file"])
        if self.index.documents == 0:
            return np.zeros(0, dtype=np.uint64)
        return np.memmap(path, dtype=np.uint64, mode="r")


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 values (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return z ^ (z >> np.uint64(31))


def held_out(n_docs: int, fraction: float) -> np.ndarray:
    """``(n_docs,)`` bool: document ``d`` is held out when a hash of ``d`` falls below
    ``fraction`` (about that fraction of the documents; at least one when there are two)."""
    if n_docs == 0 or fraction <= 0.0:
        return np.zeros(n_docs, dtype=bool)
    u = (_mix64(np.arange(n_docs, dtype=np.uint64)) >> np.uint64(11)).astype(np.float64)
    out = u / float(2**53) < fraction
    if not out.any() and n_docs >= 2:
        out[-1] = True
    if out.all():
        out[0] = False
    return out


def runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, stops)`` of the runs of True in a 1-D bool array."""
    m = np.concatenate([[False], mask.astype(bool), [False]]).astype(np.int8)
    d = np.diff(m)
    return np.flatnonzero(d == 1), np.flatnonzero(d == -1)


def mask_stream(stream: ShardStream) -> ShardStream | None:
    """The loss-mask stream beside a token stream (None when the folder has no mask)."""
    masks = stream.index.masks
    return None if masks is None else ShardStream(stream.index, masks, "uint8")


def ignore_untrained(targets: torch.Tensor, mask: np.ndarray) -> torch.Tensor:
    """``targets`` ``(batch, seq)`` with every target whose mask byte is 0 set to the loss's
    ignore index (``mask`` ``(batch, seq)`` uint8, the targets' own tokens' flags)."""
    from plait.parallel.chunked_loss import IGNORE_INDEX

    out = targets.clone()
    out[torch.from_numpy(mask == 0)] = IGNORE_INDEX
    return out


class SegmentDataset:
    """Windows of ``seq_len + 1`` tokens over token ranges ``[starts[k], stops[k])`` of a
    stream, the ranges joined in order (a window may span ranges and shards). A folder
    with a loss mask gives the ignore index as the target of every untrained token."""

    def __init__(
        self, stream: ShardStream, starts: np.ndarray, stops: np.ndarray, seq_len: int
    ) -> None:
        if seq_len <= 0:
            raise ConfigError(f"seq_len must be positive, got {seq_len}.")
        self.stream = stream
        self.masks = mask_stream(stream)
        self.seq_len = seq_len
        self.eos_id: int | None = stream.index.eos_id
        self.seg_start = np.asarray(starts, dtype=np.int64)  # (n_seg,) stream offsets
        lengths = np.asarray(stops, dtype=np.int64) - self.seg_start
        self.virtual = np.concatenate([[0], np.cumsum(lengths)])  # (n_seg + 1,)

    @property
    def num_tokens(self) -> int:
        """Tokens the windows are cut from."""
        return int(self.virtual[-1])

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def window(
        self, i: int, stream: ShardStream | None = None, span: tuple[int, int] | None = None
    ) -> np.ndarray:
        """Window ``i``: ``(seq_len + 1,)`` tokens of the stream's dtype (of ``stream``, a
        stream beside the tokens, when given); only its tokens ``span = (lo, hi)``, when
        given."""
        stream = stream or self.stream
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a dataset of {len(self)} samples")
        a, b = span or (0, self.seq_len + 1)
        lo, hi = i * self.seq_len + a, i * self.seq_len + b
        pieces = []
        k = int(np.searchsorted(self.virtual, lo, side="right")) - 1
        while lo < hi:
            end = min(hi, int(self.virtual[k + 1]))
            off = int(self.seg_start[k]) - int(self.virtual[k])
            pieces.append(stream.read(lo + off, end + off))
            lo, k = end, k + 1
        if not pieces:
            return np.zeros(0, dtype=stream.dtype)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def batch(
        self, indices: Sequence[int], parts: Parts = BOTH
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each a ``(len(indices), seq_len)`` LongTensor (only
        ``parts`` read: the loss mask with the targets)."""
        if not len(indices):
            empty = torch.empty(0, self.seq_len, dtype=torch.long)
            return empty, empty.clone()
        span = parts.span(self.seq_len)
        rows = [self.window(int(i), span=span) for i in indices]
        w = torch.from_numpy(np.stack(rows).astype(np.int64))  # (batch, hi - lo)
        x, y = split_window(w, parts, self.seq_len)  # (batch, seq) twice
        if self.masks is None or not parts.targets:
            return x, y
        tail = (1, self.seq_len + 1)  # the targets' own tokens' flags
        m = np.stack([self.window(int(i), self.masks, tail) for i in indices])  # (batch, seq)
        return x, ignore_untrained(y, m)

    def documents(self, indices: Sequence[int]) -> torch.Tensor | None:
        """None: the document ids of an unpacked window follow from its tokens
        (:mod:`plait.model.document_mask`); packed folders give them
        (:class:`~plait.data.packed.PackedDataset`)."""
        return None


def open_prepared(
    path: str, seq_len: int, val_fraction: float | None
) -> tuple[SegmentDataset, SegmentDataset | None]:
    """``(train, val)`` window sets of a prepared folder: with ``val_fraction`` the
    held-out documents are the validation set; with None every document trains (val None).
    A packed folder gives :class:`~plait.data.packed.PackedDataset` windows (held out by
    window)."""
    stream = ShardStream(read_index(path))
    if stream.index.packed is not None:
        from plait.data.packed import open_packed

        return open_packed(stream, seq_len, val_fraction)  # type: ignore[return-value]
    mapped = stream.document_ends()  # (n_docs,) uint64, memory-mapped
    if len(mapped) != stream.index.documents or (len(mapped) and mapped[-1] != len(stream)):
        raise DataError(f"{path}: documents.bin does not match the index; prepare it again.")
    if val_fraction is None:  # nothing per document is held
        whole = np.asarray([0], dtype=np.int64), np.asarray([len(stream)], dtype=np.int64)
        return SegmentDataset(stream, *whole, seq_len), None
    ends = np.asarray(mapped, dtype=np.int64)  # (n_docs,): the split is per document
    begins = np.concatenate([[0], ends[:-1]])  # (n_docs,)
    val_docs = held_out(len(ends), val_fraction)
    sets = []
    for mask in (~val_docs, val_docs):
        a, b = runs(mask)
        sets.append(SegmentDataset(stream, begins[a], ends[b - 1], seq_len))
    return sets[0], sets[1]
