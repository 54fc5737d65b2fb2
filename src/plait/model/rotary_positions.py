"""Rotary positions per token: given ``position_ids``, or restarted at each document.

By default a window's tokens are rotated by their position in the (global) sequence
(:func:`plait.model.transformer.rope_for`). Packed samples (several training samples
in one window, ``data.restart_positions`` with ``data.mask_documents``) restart at 0
at each document, so a sample computes exactly as it would alone: position = index -
start of its document (:func:`~plait.model.document_mask.restarted_positions`). The
document ids are the whole sequence's under context parallelism
(:class:`~plait.parallel.context.document_ids.ShardDocuments`) and ``positions`` gives
the global indices of the rank's tokens (zigzag or contiguous shards), so the restarted
positions are global too. Explicit ``position_ids`` ``(batch, seq)`` are the local
tokens' (as Hugging Face's ``position_ids``). Computed on the device, no host sync.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.model.document_mask import restarted_positions


def rotary_rows(
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: nn.Module,
    documents: nn.Module,
    seq: int,
    docs: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rotary table rows ``(batch, seq, head_dim // 2)`` of each token when its
    positions are per row (``position_ids`` given, or ``documents.restart_positions``
    with document ids ``docs`` ``(batch, S)``); None: the sequence's positions apply.

    ``cos``/``sin`` ``(max_seq_len, head_dim // 2)``; ``positions(seq)`` the global
    positions of the local tokens (None: ``0 .. seq-1``)."""
    if position_ids is None and getattr(documents, "restart_positions", False) and docs is not None:
        pos = positions(seq)  # (seq,) global positions of the local tokens, or None
        position_ids = restarted_positions(docs, pos)  # (batch, seq)
    if position_ids is None:
        return None
    if position_ids.dim() != 2 or position_ids.shape[1] != seq:
        raise ValueError(f"position_ids must be (batch, {seq}), got {tuple(position_ids.shape)}")
    idx = position_ids.to(cos.device)
    return cos[idx], sin[idx]
