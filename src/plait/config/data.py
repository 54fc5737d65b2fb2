"""The data section (``[data]``): where the tokens come from."""

from __future__ import annotations

from dataclasses import dataclass

from plait.config.choices import TokenDType, check_choices
from plait.errors import ConfigError


@dataclass
class DataConfig:
    """Where the tokens come from."""

    source: str = "stdlib"
    """'stdlib' (the running interpreter's standard-library sources, always present),
    a text file, a folder of text files, a pre-tokenized .bin/.npy token file, a folder
    made by `plait data prepare`, or a mixture of such folders 'DIR_A:0.7,DIR_B:0.3'."""
    tokenizer: str = "byte"
    """'byte' (built in, 256 symbols), 'tiktoken:<encoding>' (needs tiktoken) or
    'hf:<path>' (a Hugging Face tokenizer.json, or a model folder holding one)."""
    token_dtype: TokenDType = "uint16"
    """Element type of a raw pre-tokenized .bin file."""
    max_bytes: int = 8_000_000
    """Read at most this many bytes of text (0: no limit)."""
    val_fraction: float = 0.05
    """Fraction of the tokens held out (at the end) for the validation loss; of a
    prepared folder (``plait data prepare``), the fraction of its documents held out
    (chosen by a hash of the document number)."""
    val: str | None = None
    """A prepared folder whose documents are the validation set (instead of the held-out
    documents of data.source, which then all train)."""
    prefetch: int = 2
    """Batches a background thread per rank reads ahead (pinned memory on CUDA); 0 reads
    each batch when its step starts."""
    mask_documents: bool = False
    """Block-causal attention within documents: a token attends only to earlier tokens
    of its own document, a new document starting after each end-of-document token (the
    tokenizer's: id 0, the NUL byte, for 'byte'; tiktoken's end-of-text token).
    Built-in model only (sdpa, blockwise, ring and all-to-all attention), not with
    parallel.pp > 1; rotary positions stay the window's unless data.restart_positions.
    See docs/context-parallel.md."""
    restart_positions: bool = False
    """Rotary positions restart at 0 at each document (packed samples: each computes as
    it would alone). Needs data.mask_documents; built-in model (sdpa, blockwise, ring
    and all-to-all attention). See docs/context-parallel.md."""

    def __post_init__(self) -> None:
        check_choices(self, "data.")
        if not self.source:
            raise ConfigError("data.source must not be empty.")
        if self.tokenizer != "byte" and not self.tokenizer.startswith(("tiktoken:", "hf:")):
            raise ConfigError(
                "data.tokenizer must be 'byte' or 'tiktoken:<encoding>' (or 'hf:<path>'), got "
                f"{self.tokenizer!r}."
            )
        if self.restart_positions and not self.mask_documents:
            raise ConfigError(
                "data.restart_positions needs data.mask_documents (the document ids say "
                "where positions restart); set both."
            )
        if self.prefetch < 0:
            raise ConfigError(f"data.prefetch must not be negative, got {self.prefetch}.")
        if self.max_bytes < 0:
            raise ConfigError(f"data.max_bytes must not be negative, got {self.max_bytes}.")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}.")
