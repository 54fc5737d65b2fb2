"""Document masking: a window that holds several documents attends within each.

Training windows are cut from a stream of documents joined by an end-of-document
token (EOS). With ``data.mask_documents`` the attention mask is block-causal: a token
attends only to earlier tokens of its own document. The document ids are a pure
function of the window's tokens and the EOS id — a token after an EOS starts a new
document::

    doc_id[t] = number of EOS tokens at positions < t   (cumsum of is_eos, shifted by one)

so the EOS itself is the last token of its document, and no data-loader change is
needed. Rotary positions stay global by default (the window's positions, as
torchtitan keeps them): a document that starts mid-window is rotated from its window
position; the attention scores depend only on position differences, which are the
same. With ``restart_positions`` (``data.restart_positions``, for packed samples) each
document's positions start at 0 (:func:`restarted_positions`), so a sample packed into
a window is computed exactly as alone.

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


def restarted_positions(doc_ids: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """``(batch, n)`` int64 rotary positions that restart at 0 at each document start:
    ``position - first position of its document``. ``doc_ids`` ``(batch, S)`` are the
    whole sequence's (non-decreasing along a row); ``pos`` ``(n,)`` the global positions
    of the tokens wanted (default ``0 .. S-1``; a cp rank's shard under context
    parallelism). Computed on the device, without a host sync."""
    b, s = doc_ids.shape
    idx = torch.arange(s, device=doc_ids.device).expand(b, s)
    new = torch.ones_like(doc_ids, dtype=torch.bool)
    new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.cummax(torch.where(new, idx, torch.zeros_like(idx)), dim=1).values
    restarted = idx - start  # (batch, S)
    return restarted if pos is None else restarted[:, pos.to(doc_ids.device)]


class DocumentIds(nn.Module):
    """``forward(tokens) -> (batch, seq)`` document ids, or None when ``eos_id`` is None
    (no document masking). ``restart_positions``: the model's rotary positions restart
    at each document (:func:`restarted_positions`)."""

    def __init__(self, eos_id: int | None = None, restart_positions: bool = False) -> None:
        super().__init__()
        self.eos_id = eos_id
        self.restart_positions = restart_positions

    def forward(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The document ids of ``tokens`` ``(batch, seq)`` (None: masking off)."""
        return None if self.eos_id is None else document_ids(tokens, self.eos_id)


def visible(
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
    q_pos: torch.Tensor | None,
    k_pos: torch.Tensor | None,
    window: int | None = None,
) -> torch.Tensor:
    """``(batch, 1, sq, sk)`` bool (``(1, 1, sq, sk)`` without documents), True where
    query ``i`` may see key ``j``: same document (when ids are given) and, when
    positions are given (causal), ``k_pos[j] <= q_pos[i]`` and, with a ``window``,
    ``q_pos[i] - k_pos[j] < window``. ``q_doc`` ``(batch, sq)``, ``k_doc`` ``(batch,
    sk)``; positions ``(sq,)``/``(sk,)``, global (the window counts positions)."""
    same = None
    if q_doc is not None and k_doc is not None:
        same = q_doc[:, None, :, None] == k_doc[:, None, None, :]
    if q_pos is None or k_pos is None:
        if same is None:
            raise ValueError("a mask needs document ids or positions")
        return same
    dev = q_doc.device if q_doc is not None else q_pos.device
    qp, kp = q_pos.to(dev)[:, None], k_pos.to(dev)[None, :]
    past = kp <= qp  # (sq, sk)
    if window is not None:
        past = past & (qp - kp < window)
    return past[None, None] if same is None else same & past[None, None]


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as an additive one: 0 visible, -inf masked."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, float("-inf"))
