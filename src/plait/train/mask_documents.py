"""``data.mask_documents``: the end-of-document id of the run's tokenizer, given to the
model before it is parallelised (:mod:`plait.model.document_mask` explains the mask),
with ``data.restart_positions`` (rotary positions restart at each document).

The end-of-document token is the tokenizer's own where it names one (an ``eos_id``
attribute), tiktoken's end-of-text token (``<|endoftext|>``) for ``tiktoken:NAME``,
and 0 (the NUL byte, which text never holds) for the byte tokenizer: a corpus that
separates its documents with NUL bytes gets one document per piece. A prepared folder
(or mixture) uses the ``eos_id`` its ``index.json`` records.
"""

from __future__ import annotations

from torch import nn

from plait.config import Config
from plait.data import make_tokenizer
from plait.data.sources import data_eos_id, data_tokenizer
from plait.errors import ConfigError
from plait.model.document_mask import DocumentIds
from plait.model.hf_positions import add_packed_positions

BYTE_EOS = 0
"""The byte tokenizer's end-of-document id: the NUL byte."""


def eos_id(tokenizer: str) -> int:
    """The end-of-document id of the tokenizer ``data.tokenizer`` names."""
    if tokenizer == "byte":
        return BYTE_EOS
    tok = make_tokenizer(tokenizer)
    own = getattr(tok, "eos_id", None)
    if own is not None:
        return int(own)
    enc = getattr(tok, "_enc", None)
    eot = getattr(enc, "eot_token", None)
    if eot is None:
        raise ConfigError(
            f"data.mask_documents needs an end-of-document token; the tokenizer "
            f"{tokenizer!r} has none. Leave data.mask_documents off."
        )
    return int(eot)


def enable_document_mask(model: nn.Module, cfg: Config) -> None:
    """Turn on document masking in ``model`` (before ``parallelize``) when
    ``data.mask_documents`` asks for it: the built-in Transformer's ``documents``
    module, or a Hugging Face class's restarted ``position_ids``
    (:mod:`plait.model.hf_positions`, with ``data.restart_positions``)."""
    if not cfg.data.mask_documents:
        return
    builtin = isinstance(getattr(model, "documents", None), DocumentIds)
    hf = cfg.model.family != "plait" and cfg.model.factory is None
    if not builtin and not (hf and cfg.data.restart_positions):
        raise ConfigError(
            f"data.mask_documents needs plait's built-in Transformer (a 'documents' "
            f"module), or a Hugging Face class with data.restart_positions; "
            f"{type(model).__name__} has none."
        )
    own = data_eos_id(cfg.data)  # a prepared folder's recorded id comes first
    eos = own if own is not None else eos_id(data_tokenizer(cfg.data))
    if builtin:
        model.documents = DocumentIds(eos, restart_positions=cfg.data.restart_positions)
    else:
        add_packed_positions(model, eos)
