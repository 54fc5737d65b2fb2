"""Which tokens of the sequence a cp rank holds, and their global positions.

The sequence of length ``S`` is cut into ``2·cp`` equal chunks of ``c = S / (2·cp)``:

* ``zigzag`` (ring attention's causal load balance): rank ``r`` holds chunks ``r`` and
  ``2·cp - 1 - r``, so every rank has one early and one late chunk and, under a causal
  mask, the same number of visible (query, key) pairs: ``(2·cp - 1)·c² + c·(c + 1)``;
* ``contiguous``: rank ``r`` holds chunks ``2r`` and ``2r + 1`` (one contiguous shard;
  all-to-all attention's layout, and the unbalanced ring): rank ``r`` sees
  ``2c·(2rc) + c·(2c + 1)`` pairs, growing with ``r``.

A rank's local sequence is its chunks concatenated in increasing order.
"""

from __future__ import annotations

from typing import Literal

import torch

SeqLayout = Literal["zigzag", "contiguous"]


def chunk_ids(layout: SeqLayout, cp: int, index: int) -> tuple[int, int]:
    """The two global chunk indices (of ``2·cp``) rank ``index`` holds, in local order."""
    if layout == "zigzag":
        return index, 2 * cp - 1 - index
    if layout == "contiguous":
        return 2 * index, 2 * index + 1
    raise ValueError(f"sequence layout must be zigzag or contiguous, got {layout!r}")


def local_positions(layout: SeqLayout, cp: int, index: int, local_len: int) -> torch.Tensor:
    """Global positions ``(local_len,)`` int64 of the tokens rank ``index`` holds."""
    if local_len % 2:
        raise ValueError(f"a cp shard of {local_len} tokens does not hold two equal chunks")
    c = local_len // 2
    a, b = chunk_ids(layout, cp, index)
    return torch.cat((torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)))


def shard_sequence(
    x: torch.Tensor, layout: SeqLayout, cp: int, index: int, dim: int = 1
) -> torch.Tensor:
    """Rank ``index``'s tokens of ``x`` along ``dim`` (the whole sequence of length S)."""
    s = x.shape[dim]
    if s % (2 * cp):
        raise ValueError(f"sequence length {s} is not divisible by 2·cp = {2 * cp}")
    chunks = x.chunk(2 * cp, dim=dim)
    a, b = chunk_ids(layout, cp, index)
    return torch.cat((chunks[a], chunks[b]), dim=dim)


def unshard_sequence(parts: list[torch.Tensor], layout: SeqLayout, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard (``parts[r]`` of rank ``r``)."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        a, b = chunk_ids(layout, cp, r)
        chunks[a], chunks[b] = part.chunk(2, dim=dim)
    return torch.cat([c for c in chunks if c is not None], dim=dim)


def causal_pairs(layout: SeqLayout, cp: int, index: int, seq_len: int) -> int:
    """Visible (query, key) pairs of rank ``index`` under a causal mask (per head)."""
    c = seq_len // (2 * cp)
    return sum(g * c * c + c * (c + 1) // 2 for g in chunk_ids(layout, cp, index))
