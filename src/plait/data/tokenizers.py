"""Tokenizers: ``byte`` (built in), ``tiktoken:NAME`` and ``hf:PATH`` (a Hugging Face
``tokenizer.json``, or a model folder holding one, read with the ``tokenizers`` library).

Every tokenizer exposes :attr:`name` (the spec it was made from), :attr:`vocab_size` and
:attr:`eos_id` (the end-of-document token that ``plait data prepare`` appends to every
document; the byte tokenizer uses byte 0, which UTF-8 text never holds).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from plait.errors import DataError, install_hint

if TYPE_CHECKING:  # only for hints: `plait data prepare` runs without torch
    import torch

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
"""Token names taken as end-of-document when a tokenizer folder does not say which."""


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, data: bytes | str) -> np.ndarray:
        """Token ids of ``data`` as a 1-D unsigned integer array."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Text of the token ids."""
        ...


def _id_list(ids: Sequence[int] | np.ndarray | torch.Tensor) -> list[int]:
    if hasattr(ids, "detach"):  # a torch tensor
        return [int(i) for i in ids.reshape(-1).tolist()]  # type: ignore[union-attr]
    return [int(i) for i in np.asarray(ids).reshape(-1)]


class ByteTokenizer:
    """One token per UTF-8 byte: vocabulary 256, lossless for any bytes."""

    name = "byte"
    vocab_size = 256
    eos_id: int | None = 0
    """Byte 0 (NUL): never part of UTF-8 text, so it marks a document's end."""

    def encode(self, data: bytes | str) -> np.ndarray:
        """``(n_bytes,)`` uint16 ids."""
        raw = data.encode("utf-8") if isinstance(data, str) else data
        return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Text of the bytes (invalid UTF-8 sequences become U+FFFD)."""
        return bytes(_id_list(ids)).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """A ``tiktoken`` BPE encoding (needs the optional ``tiktoken`` package)."""

    def __init__(self, encoding_name: str) -> None:
        try:
            import tiktoken
        except ImportError as exc:
            raise DataError(
                f"data.tokenizer 'tiktoken:{encoding_name}' needs the tiktoken package, which "
                f"is not installed; install it with {install_hint('tiktoken', 'tiktoken')}, or "
                "use data.tokenizer 'byte'."
            ) from exc
        try:
            self._enc = tiktoken.get_encoding(encoding_name)
        except (ValueError, KeyError) as exc:
            raise DataError(
                f"tiktoken has no encoding {encoding_name!r} (or could not load it): {exc}"
            ) from exc
        self.name = f"tiktoken:{encoding_name}"
        self.vocab_size = int(self._enc.n_vocab)
        self.eos_id: int | None = getattr(self._enc, "eot_token", None)

    def encode(self, data: bytes | str) -> np.ndarray:
        """``(n_tokens,)`` uint32 ids; special-token text is encoded as ordinary text."""
        text = data.decode("utf-8", errors="ignore") if isinstance(data, bytes) else data
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.uint32)

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Text of the token ids."""
        return str(self._enc.decode(_id_list(ids)))


def hf_tokenizer_file(path: str | Path) -> Path | None:
    """The ``tokenizer.json`` of ``path`` (the file itself, or inside a folder), or None."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    return p if p.is_file() else None


def _folder_eos(folder: Path) -> str | None:
    """The eos token named by a model folder's tokenizer_config.json, if any."""
    cfg = folder / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        eos = json.loads(cfg.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


class HFTokenizer:
    """A Hugging Face fast tokenizer from a ``tokenizer.json`` (the ``tokenizers`` library)."""

    def __init__(self, path: str) -> None:
        file = hf_tokenizer_file(path)
        if file is None:
            raise DataError(
                f"data.tokenizer 'hf:{path}': no tokenizer.json there; give a tokenizer.json "
                "file or a model folder that holds one."
            )
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError as exc:
            raise DataError(
                f"data.tokenizer 'hf:{path}' needs the tokenizers package; install it with "
                f"{install_hint('data', 'tokenizers')}."
            ) from exc
        try:
            self._tok = RustTokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise DataError(f"{file}: not a readable tokenizer.json ({exc}).") from exc
        self.name = f"hf:{path}"
        self.path = file
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        named = _folder_eos(file.parent)
        candidates = (named, *EOS_NAMES) if named else EOS_NAMES
        self.eos_id: int | None = None
        for token in candidates:
            tid = self._tok.token_to_id(token)
            if tid is not None:
                self.eos_id = int(tid)
                break

    def encode(self, data: bytes | str) -> np.ndarray:
        """``(n_tokens,)`` uint32 ids, without added special tokens."""
        text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """:meth:`encode` of every text (the library's batch path)."""
        out = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in out]

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Text of the token ids (special tokens kept)."""
        return str(self._tok.decode(_id_list(ids), skip_special_tokens=False))


AnyTokenizer = ByteTokenizer | TiktokenTokenizer | HFTokenizer
"""Every tokenizer :func:`make_tokenizer` returns."""


def make_tokenizer(spec: str) -> AnyTokenizer:
    """``"byte"``, ``"tiktoken:<encoding>"`` (e.g. ``"tiktoken:gpt2"``) or ``"hf:<path>"``
    (a ``tokenizer.json`` or a folder holding one)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("tiktoken:") and spec != "tiktoken:":
        return TiktokenTokenizer(spec.removeprefix("tiktoken:"))
    if spec.startswith("hf:") and spec != "hf:":
        return HFTokenizer(spec.removeprefix("hf:"))
    raise DataError(
        f"unknown tokenizer {spec!r}; use 'byte', 'tiktoken:<encoding>' or 'hf:<path>'."
    )


def check_covers_vocab(tokenizer_vocab: int, model_vocab: int, what: str) -> None:
    """Refuse a model whose vocabulary does not cover the tokenizer's (``what`` names it)."""
    if tokenizer_vocab > model_vocab:
        raise DataError(
            f"{what} has a vocabulary of {tokenizer_vocab:,} tokens but model.vocab_size is "
            f"{model_vocab:,}; set --model.vocab_size {tokenizer_vocab} (or more)."
        )
