"""Fixed-length samples of a token array: sample ``i`` of a :class:`TokenDataset` is the
window ``tokens[i·seq : i·seq + seq + 1]``: inputs are its first ``seq`` tokens, targets
the last ``seq``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from plait.data.parts import BOTH, Parts, split_window
from plait.data.read_count import READ
from plait.errors import ConfigError, DataError


class WindowSet(Protocol):
    """What the trainer needs of a training or validation set (in-memory or sharded)."""

    seq_len: int
    eos_id: int | None

    def __len__(self) -> int: ...

    @property
    def num_tokens(self) -> int:
        """Tokens the set reads its windows from."""
        ...

    def batch(
        self, indices: Sequence[int], parts: Parts = BOTH
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each a ``(len(indices), seq_len)`` LongTensor; a target
        the loss must skip (an untrained token of chat data) is the ignore index, -100.
        Only the ``parts`` asked for are read; the others are absent tensors
        (:mod:`plait.data.parts`)."""
        ...

    def documents(self, indices: Sequence[int]) -> torch.Tensor | None:
        """``(len(indices), seq_len)`` int64 document (sample) number of every input token
        within its window, for packed data; None where the ids follow from the tokens."""
        ...


class TokenDataset:
    """Non-overlapping windows of ``seq_len + 1`` tokens (last token shared with the next)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, eos_id: int | None = None) -> None:
        if seq_len <= 0:
            raise ConfigError(f"seq_len must be positive, got {seq_len}.")
        self.tokens = tokens  # (n_tokens,)
        self.seq_len = seq_len
        self.eos_id = eos_id
        """The end-of-document token of the data, when known (None: unknown)."""

    @property
    def num_tokens(self) -> int:
        """Tokens the windows are cut from."""
        return len(self.tokens)

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def _window(self, i: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Tokens ``[lo, hi)`` of window ``i`` (default all ``seq + 1``), copied."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a dataset of {len(self)} samples")
        start = i * self.seq_len
        hi = self.seq_len + 1 if hi is None else hi
        out = np.array(self.tokens[start + lo : start + hi])  # (hi - lo,)
        READ.add(out.nbytes)
        return out

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each a ``(seq_len,)`` LongTensor."""
        w = torch.from_numpy(self._window(i).astype(np.int64))
        return w[:-1], w[1:]

    def batch(
        self, indices: Sequence[int], parts: Parts = BOTH
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each a ``(len(indices), seq_len)`` LongTensor (only
        ``parts`` read)."""
        if not len(indices):
            empty = torch.empty(0, self.seq_len, dtype=torch.long)
            return empty, empty.clone()
        lo, hi = parts.span(self.seq_len)
        rows = [self._window(int(i), lo, hi) for i in indices]
        w = torch.from_numpy(np.stack(rows).astype(np.int64))  # (batch, hi - lo)
        return split_window(w, parts, self.seq_len)

    def documents(self, indices: Sequence[int]) -> torch.Tensor | None:
        """None: the document ids follow from the tokens (:mod:`plait.model.document_mask`)."""
        return None


def check_enough(dataset: WindowSet, global_batch: int, name: str) -> None:
    """Raise DataError when ``dataset`` has fewer samples than one global batch."""
    if len(dataset) < global_batch:
        raise DataError(
            f"the {name} set has {len(dataset)} sample(s) of {dataset.seq_len} + 1 tokens "
            f"({dataset.num_tokens} tokens) but one global batch needs {global_batch}; use "
            "more data (a larger source or data.max_bytes), a smaller train.global_batch, "
            "a shorter train.seq_len, or (for validation) a larger data.val_fraction."
        )
