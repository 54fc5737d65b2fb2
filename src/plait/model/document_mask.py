"""Document masking: a window that holds several documents attends within each.

Training windows are cut from a stream of documents joined by an end-of-document
token (EOS). With ``data.mask_documents`` the attention mask is block-causal: a token
attends only to earlier tokens of its own document. The document ids are a pure
function of the window's tokens and the EOS id — a token after an EOS starts a new
document::

    doc_id[t] = number of EOS tokens at positions < t   (cumsum of is_eos, shifted by one)

so the EOS itself is the last token of its document, and no data-loader change is
needed. Rotary positions stay global (the window's positions, as torchtitan keeps
them): a document that starts mid-window is rotated from its window position; the
attention scores depend only on position differences, which are the same.

:class:`DocumentIds` is the model's ``documents`` module (``eos_id`` None: no
masking). Context parallelism replaces it from outside with one that returns the ids
of the whole sequence (:mod:`plait.parallel.context.document_ids`), as it replaces
``positions``.
"""

from __future__ import annotations

import torch
from torch import nn


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``(batch, seq)`` int64 document index of every token (0 for the first)."""
    eos = (tokens == eos_id).long()  # (batch, seq)
    return torch.cumsum(eos, dim=1) - eos


class DocumentIds(nn.Module):
    """``forward(tokens) -> (batch, seq)`` document ids, or None when ``eos_id`` is None
    (no document masking)."""

    def __init__(self, eos_id: int | None = None) -> None:
        super().__init__()
        self.eos_id = eos_id

    def forward(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The document ids of ``tokens`` ``(batch, seq)`` (None: masking off)."""
        return None if self.eos_id is None else document_ids(tokens, self.eos_id)


def visible(
    q_doc: torch.Tensor,
    k_doc: torch.Tensor,
    q_pos: torch.Tensor | None,
    k_pos: torch.Tensor | None,
) -> torch.Tensor:
    """``(batch, 1, sq, sk)`` bool, True where query ``i`` may see key ``j``: same
    document and, when positions are given (causal), ``k_pos[j] <= q_pos[i]``.
    ``q_doc`` ``(batch, sq)``, ``k_doc`` ``(batch, sk)``; positions ``(sq,)``/``(sk,)``."""
    same = q_doc[:, None, :, None] == k_doc[:, None, None, :]
    if q_pos is None or k_pos is None:
        return same
    past = k_pos.to(q_doc.device)[None, :] <= q_pos.to(q_doc.device)[:, None]  # (sq, sk)
    return same & past[None, None]


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as an additive one: 0 visible, -inf masked."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, float("-inf"))
