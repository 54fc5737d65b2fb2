"""The index of a prepared folder (``index.json``), written last by ``plait data prepare``.

A prepared folder holds::

    index.json           this index (its presence marks the folder as finished)
    shard_00000.bin ...  raw token arrays of ``dtype`` (uint16 or uint32), memory-mappable;
                         every shard holds ``shard_tokens`` tokens but the last
    documents.bin        uint64 end offsets of the documents in the token stream (the
                         stream is the shards in order; each document ends with ``eos_id``)

``index.json`` holds ``format`` (``"plait-shards"``), ``version``, ``tokenizer`` (the
spec), ``vocab_size``, ``eos_id``, ``dtype``, ``shard_tokens``, ``documents``, ``tokens``,
``shards`` (``file``, ``tokens``, ``sha256`` each), ``document_ends`` (``file``,
``sha256``) and ``source`` (what was read, with ``field``).

Chat or instruction data, and packed data (:mod:`plait.data.sample_prepare`), add
(index version 2)::

    mask_00000.bin ...   uint8 loss mask beside each shard, one byte a token (1: the token
                         is a trained target)
    "masks"              the mask shards (``file``, ``tokens``, ``sha256`` each)
    "samples"            what was prepared: ``kind`` (chat | text), ``train_on``,
                         ``template``, ``samples``, ``trained_tokens``, ``dropped``,
                         ``truncated``
    "packed"             for ``--pack SEQ_LEN``: ``seq_len``, ``window`` (= seq_len + 1
                         tokens), ``windows``, ``real_tokens``, ``algorithm``, ``buffer``;
                         the stream is then whole windows, and the documents are the
                         samples and the padding runs
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.config import TOKEN_DTYPES
from plait.errors import DataError

INDEX_NAME = "index.json"
"""File name of the index inside a prepared folder."""

FORMAT = "plait-shards"
"""``index.json``'s ``format`` value."""

VERSION = 1
"""``index.json``'s ``version`` value for plain token shards."""

VERSION_SAMPLES = 2
"""``index.json``'s ``version`` with a loss mask or packed windows."""

DOCUMENTS_NAME = "documents.bin"
"""File of the documents' end offsets (uint64)."""


def shard_name(i: int) -> str:
    """File name of shard ``i``."""
    return f"shard_{i:05d}.bin"


def token_dtype_for(vocab_size: int) -> str:
    """The smallest token dtype that holds ids ``[0, vocab_size)``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def dtype_holds(dtype: str, vocab_size: int) -> bool:
    """Whether ``dtype`` holds every id of a vocabulary of ``vocab_size``."""
    return vocab_size <= (2**16 if dtype == "uint16" else 2**32)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes (read in 8 MiB blocks)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` is a folder with a prepared-data index."""
    p = Path(path).expanduser()
    return p.is_dir() and (p / INDEX_NAME).is_file()


@dataclass(frozen=True)
class ShardIndex:
    """A prepared folder's index, read and checked."""

    root: Path
    tokenizer: str
    vocab_size: int
    eos_id: int
    dtype: str
    shard_tokens: int
    documents: int
    tokens: int
    shards: list[dict[str, Any]]
    document_ends: dict[str, Any]
    source: dict[str, Any]
    masks: list[dict[str, Any]] | None = None
    """The loss-mask shards (one beside each token shard), None for plain text."""
    samples: dict[str, Any] | None = None
    """What chat/instruction or packed preparation did (see the module's docstring)."""
    packed: dict[str, Any] | None = None
    """The packing of ``--pack`` (see the module's docstring), None when unpacked."""

    @property
    def packing_efficiency(self) -> float | None:
        """Real tokens / window tokens of a packed folder (None when unpacked)."""
        if self.packed is None:
            return None
        return int(self.packed["real_tokens"]) / max(1, self.tokens)

    def as_json(self) -> dict[str, Any]:
        """The index as written to ``index.json``."""
        extra = {
            k: v
            for k, v in (("masks", self.masks), ("samples", self.samples), ("packed", self.packed))
            if v is not None
        }
        return {
            "format": FORMAT,
            "version": VERSION_SAMPLES if extra else VERSION,
            "tokenizer": self.tokenizer,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "dtype": self.dtype,
            "shard_tokens": self.shard_tokens,
            "documents": self.documents,
            "tokens": self.tokens,
            "shards": self.shards,
            "document_ends": self.document_ends,
            "source": self.source,
            **extra,
        }

    def write(self) -> None:
        """Write ``index.json`` atomically (temp name, then rename)."""
        tmp = self.root / (INDEX_NAME + ".tmp")
        tmp.write_text(json.dumps(self.as_json(), indent=1) + "\n", encoding="utf-8")
        tmp.replace(self.root / INDEX_NAME)

    def problems(self, checksums: bool = True) -> list[str]:
        """What is wrong with the folder's files (missing, wrong size, wrong checksum)."""
        item = 2 if self.dtype == "uint16" else 4
        out: list[str] = []
        files = [(s["file"], s["tokens"] * item, s["sha256"]) for s in self.shards]
        files += [(m["file"], m["tokens"], m["sha256"]) for m in self.masks or []]
        files.append((self.document_ends["file"], self.documents * 8, self.document_ends["sha256"]))
        for name, size, digest in files:
            f = self.root / name
            if not f.is_file():
                out.append(f"{f} is missing")
            elif f.stat().st_size != size:
                out.append(f"{f} is {f.stat().st_size} bytes, the index says {size}")
            elif checksums and sha256_file(f) != digest:
                out.append(f"{f}: its SHA-256 differs from the index's")
        return out


def read_index(path: str | Path) -> ShardIndex:
    """The index of the prepared folder ``path`` (DataError when absent or malformed)."""
    root = Path(path).expanduser()
    file = root / INDEX_NAME
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise DataError(f"{root} is not a prepared folder (no {INDEX_NAME}).") from exc
    except (OSError, ValueError) as exc:
        raise DataError(f"{file}: cannot read the index ({exc}).") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise DataError(f"{file} is not a plait prepared-data index (format {FORMAT!r}).")
    if raw.get("version") not in (VERSION, VERSION_SAMPLES):
        raise DataError(
            f"{file} has index version {raw.get('version')}; this plait reads {VERSION} and "
            f"{VERSION_SAMPLES}."
        )
    try:
        idx = ShardIndex(
            root=root,
            tokenizer=str(raw["tokenizer"]),
            vocab_size=int(raw["vocab_size"]),
            eos_id=int(raw["eos_id"]),
            dtype=str(raw["dtype"]),
            shard_tokens=int(raw["shard_tokens"]),
            documents=int(raw["documents"]),
            tokens=int(raw["tokens"]),
            shards=list(raw["shards"]),
            document_ends=dict(raw["document_ends"]),
            source=dict(raw.get("source", {})),
            masks=None if raw.get("masks") is None else list(raw["masks"]),
            samples=None if raw.get("samples") is None else dict(raw["samples"]),
            packed=None if raw.get("packed") is None else dict(raw["packed"]),
        )
        if idx.masks is not None and [int(m["tokens"]) for m in idx.masks] != [
            int(s["tokens"]) for s in idx.shards
        ]:
            raise ValueError("the mask shards do not match the token shards")
        shard_tokens = sum(int(s["tokens"]) for s in idx.shards)
        for entry in [*idx.shards, idx.document_ends]:
            str(entry["file"]), str(entry["sha256"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{file}: malformed index ({exc!r}).") from exc
    if idx.dtype not in TOKEN_DTYPES:
        raise DataError(f"{file}: token dtype {idx.dtype!r} is not uint16 or uint32.")
    if shard_tokens != idx.tokens:
        raise DataError(f"{file}: the shards' token counts do not add up to {idx.tokens}.")
    return idx
