"""Tokens for training: tokenizers, corpus loading, fixed-length samples, batch order.

Sources (``DataConfig.source``):

* ``"stdlib"``: the running interpreter's standard-library ``.py`` files (always present),
  sorted by relative path, ``site-packages``/``dist-packages`` and test folders skipped;
* a text file, or a folder of text files read recursively in sorted order (hidden entries
  and files that are binary or not UTF-8 are skipped);
* a pre-tokenized ``.npy`` array or raw ``.bin`` array of ``DataConfig.token_dtype``.

Text is read as bytes, joined with :data:`SEPARATOR`, cut at ``DataConfig.max_bytes`` and
tokenized. Sample ``i`` of a :class:`TokenDataset` is the window
``tokens[i·seq : i·seq + seq + 1]``: inputs are its first ``seq`` tokens, targets the
last ``seq``. :class:`BatchSampler` gives the global batch of every optimizer step as a
pure function of ``(seed, step)``, so a run resumes at any step with no saved state and
the data order does not depend on the data-parallel degree.
"""

from __future__ import annotations

import codecs
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from plait.config import DataConfig
from plait.errors import ConfigError, DataError, install_hint

SEPARATOR = b"\n\n"
"""Bytes put between two files of a text corpus."""

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    vocab_size: int

    def encode(self, data: bytes | str) -> np.ndarray:
        """Token ids of ``data`` as a 1-D unsigned integer array."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Text of the token ids."""
        ...


def _id_list(ids: Sequence[int] | np.ndarray | torch.Tensor) -> list[int]:
    if isinstance(ids, torch.Tensor):
        return [int(i) for i in ids.reshape(-1).tolist()]
    return [int(i) for i in np.asarray(ids).reshape(-1)]


class ByteTokenizer:
    """One token per UTF-8 byte: vocabulary 256, lossless for any bytes."""

    name = "byte"
    vocab_size = 256

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

    def encode(self, data: bytes | str) -> np.ndarray:
        """``(n_tokens,)`` uint32 ids; special-token text is encoded as ordinary text."""
        text = data.decode("utf-8", errors="ignore") if isinstance(data, bytes) else data
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.uint32)

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Text of the token ids."""
        return str(self._enc.decode(_id_list(ids)))


def make_tokenizer(spec: str) -> ByteTokenizer | TiktokenTokenizer:
    """``"byte"`` or ``"tiktoken:<encoding>"`` (e.g. ``"tiktoken:gpt2"``)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("tiktoken:") and spec != "tiktoken:":
        return TiktokenTokenizer(spec.removeprefix("tiktoken:"))
    raise DataError(f"unknown tokenizer {spec!r}; use 'byte' or 'tiktoken:<encoding>'.")


def _read_text(path: Path, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of ``path`` (0: all), or None when it is not UTF-8 text."""
    with path.open("rb") as f:
        data = f.read(limit) if limit > 0 else f.read()
        truncated = limit > 0 and f.read(1) != b""
    if b"\x00" in data:
        return None
    try:  # a cut may split a multi-byte character: only a complete file must end cleanly
        codecs.getincrementaldecoder("utf-8")().decode(data, final=not truncated)
    except UnicodeDecodeError:
        return None
    return data


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _sorted_files(root: Path, suffix: str | None) -> list[Path]:
    """Files under ``root``, sorted by relative POSIX path; hidden and skipped folders pruned."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS]
        for name in filenames:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            found.append(Path(dirpath) / name)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _join_texts(files: list[Path], max_bytes: int) -> bytes:
    """Concatenate the text files (non-text ones skipped) with SEPARATOR, cut at max_bytes."""
    parts: list[bytes] = []
    total = 0
    for path in files:
        if max_bytes and total >= max_bytes:
            break
        data = _read_text(path, max_bytes - total if max_bytes else 0)
        if not data:
            continue
        if parts:
            parts.append(SEPARATOR)
            total += len(SEPARATOR)
        parts.append(data)
        total += len(data)
    joined = b"".join(parts)
    return joined[:max_bytes] if max_bytes else joined


def read_corpus(cfg: DataConfig) -> bytes:
    """The text bytes of a text source (``"stdlib"``, a text file or a folder)."""
    if cfg.source == "stdlib":
        root = stdlib_root()
        data = _join_texts(_sorted_files(root, ".py"), cfg.max_bytes)
        if not data:
            raise DataError(f"found no standard-library .py files under {root}.")
        return data
    path = Path(cfg.source).expanduser()
    if not path.exists():
        raise DataError(
            f"data.source {str(path)!r} does not exist; give 'stdlib', a text file, a folder "
            "of text files, or a pre-tokenized .npy/.bin file."
        )
    if path.is_dir():
        data = _join_texts(_sorted_files(path, None), cfg.max_bytes)
        if not data:
            raise DataError(
                f"data.source folder {str(path)!r} holds no non-empty UTF-8 text files "
                "(hidden, binary and undecodable files are skipped)."
            )
        return data
    text = _read_text(path, cfg.max_bytes)
    if text is None:
        raise DataError(
            f"data.source {str(path)!r} is not UTF-8 text; give a text file, or a "
            "pre-tokenized file named *.npy or *.bin."
        )
    if not text:
        raise DataError(f"data.source {str(path)!r} is empty.")
    return text


def truncation_note(cfg: DataConfig) -> str | None:
    """A sentence saying that ``data.max_bytes`` cuts the user's text source, or None.

    Only a user's text file or folder is reported (the built-in ``stdlib`` corpus is cut
    on purpose, and pre-tokenized files are read whole); sizes come from the file system.
    """
    path = Path(cfg.source).expanduser()
    if cfg.source == "stdlib" or not cfg.max_bytes or path.suffix in (".npy", ".bin"):
        return None
    if path.is_file():
        size = path.stat().st_size
    elif path.is_dir():
        size = sum(f.stat().st_size for f in _sorted_files(path, None))
    else:
        return None
    if size <= cfg.max_bytes:
        return None
    return (
        f"data.source {str(path)!r} holds {size:,} bytes; only the first "
        f"{cfg.max_bytes:,} are used (data.max_bytes; set it to 0 to read everything)"
    )


def _load_pretokenized(path: Path, cfg: DataConfig) -> np.ndarray:
    """A memory-mapped 1-D token array from a .npy or raw .bin file."""
    if not path.is_file():
        raise DataError(f"data.source {str(path)!r} does not exist or is not a file.")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise DataError(f"cannot read {str(path)!r} as a .npy array: {exc}") from exc
        if arr.ndim != 1 or arr.dtype.kind not in "ui":
            raise DataError(
                f"{str(path)!r} holds a {arr.ndim}-D {arr.dtype} array; a pre-tokenized .npy "
                "must be a 1-D integer array (uint16 or uint32)."
            )
    else:
        dtype = np.dtype(cfg.token_dtype)
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise DataError(
                f"{str(path)!r} is {size} bytes, not a whole number of {cfg.token_dtype} "
                "tokens; check data.token_dtype."
            )
        if size == 0:
            raise DataError(f"data.source {str(path)!r} is empty.")
        arr = np.memmap(path, dtype=dtype, mode="r")
    if arr.size == 0:
        raise DataError(f"data.source {str(path)!r} is empty.")
    return arr


def load_tokens(cfg: DataConfig) -> np.ndarray:
    """The 1-D token array of ``cfg.source`` (unsigned ints; memory-mapped for .npy/.bin)."""
    path = Path(cfg.source).expanduser()
    if cfg.source != "stdlib" and path.suffix in (".npy", ".bin"):
        tokens = _load_pretokenized(path, cfg)
    else:
        tokens = make_tokenizer(cfg.tokenizer).encode(read_corpus(cfg))
    if tokens.size < 2:
        raise DataError(
            f"data.source {cfg.source!r} gives only {tokens.size} token(s); at least one "
            "sample of seq_len + 1 tokens is needed."
        )
    return tokens


def check_vocab(tokens: np.ndarray, vocab_size: int, name: str) -> None:
    """Raise DataError when a token id of ``tokens`` is outside ``[0, vocab_size)``."""
    if not tokens.size:
        return
    low, top = int(tokens.min()), int(tokens.max())
    if low < 0 or top >= vocab_size:
        raise DataError(
            f"the {name} tokens contain id {low if low < 0 else top}, but ids must lie in "
            f"[0, model.vocab_size = {vocab_size}); "
            "raise model.vocab_size or use the tokenizer the data was made with."
        )


def split_train_val(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` views: the last ``val_fraction`` of the tokens is held out."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction}.")
    cut = len(tokens) - int(len(tokens) * val_fraction)
    return tokens[:cut], tokens[cut:]


class TokenDataset:
    """Non-overlapping windows of ``seq_len + 1`` tokens (last token shared with the next)."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if seq_len <= 0:
            raise ConfigError(f"seq_len must be positive, got {seq_len}.")
        self.tokens = tokens  # (n_tokens,)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def _window(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a dataset of {len(self)} samples")
        start = i * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1])  # (seq + 1,)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each a ``(seq_len,)`` LongTensor."""
        w = torch.from_numpy(self._window(i).astype(np.int64))
        return w[:-1], w[1:]

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each a ``(len(indices), seq_len)`` LongTensor."""
        if not len(indices):
            empty = torch.empty(0, self.seq_len, dtype=torch.long)
            return empty, empty.clone()
        windows = np.stack([self._window(int(i)) for i in indices]).astype(np.int64)
        w = torch.from_numpy(windows)  # (batch, seq + 1)
        return w[:, :-1], w[:, 1:]


def check_enough(dataset: TokenDataset, global_batch: int, name: str) -> None:
    """Raise DataError when ``dataset`` has fewer samples than one global batch."""
    if len(dataset) < global_batch:
        raise DataError(
            f"the {name} set has {len(dataset)} sample(s) of {dataset.seq_len} + 1 tokens "
            f"({len(dataset.tokens)} tokens) but one global batch needs {global_batch}; use "
            "more data (a larger source or data.max_bytes), a smaller train.global_batch, "
            "a shorter train.seq_len, or (for validation) a larger data.val_fraction."
        )


def _epoch_seed(seed: int, epoch: int) -> int:
    """Deterministic 63-bit seed of one epoch's permutation (splitmix64-style mixing)."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E37_79B9_7F4A_7C15 + (epoch + 1) * 0xBF58_476D_1CE4_E5B9) & mask
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & mask
    return (z ^ (z >> 31)) >> 1


class BatchSampler:
    """Sample indices of every optimizer step, for one data-parallel rank.

    The samples are visited in a fresh seeded permutation each epoch; global batch
    ``step`` is positions ``[step·G, (step+1)·G)`` of the concatenated permutations
    (a batch may straddle two epochs, and then may hold a sample twice; never when
    ``num_samples`` is a multiple of the global batch). Rank ``r`` of ``D`` takes the
    contiguous slice ``[r·G/D, (r+1)·G/D)`` of it. All of it is a pure function of
    ``(seed, step)``.
    """

    def __init__(
        self, num_samples: int, global_batch: int, dp_rank: int, dp_size: int, seed: int
    ) -> None:
        if global_batch <= 0 or dp_size <= 0:
            raise ConfigError("global_batch and dp_size must be positive.")
        if global_batch % dp_size:
            raise ConfigError(
                f"the global batch ({global_batch}) must be divisible by the data-parallel "
                f"degree ({dp_size})."
            )
        if not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank {dp_rank} is not in [0, {dp_size}).")
        if num_samples < global_batch:
            raise DataError(
                f"{num_samples} sample(s) cannot fill a global batch of {global_batch}."
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.step = 0
        """Next step :meth:`__iter__` yields; the only state."""
        self._perms: dict[int, list[int]] = {}  # cache of recent epochs' permutations

    @property
    def per_rank(self) -> int:
        """Samples of one rank per optimizer step."""
        return self.global_batch // self.dp_size

    def epoch_of(self, step: int) -> float:
        """Fractional epoch at the start of ``step``."""
        return step * self.global_batch / self.num_samples

    def permutation(self, epoch: int) -> list[int]:
        """Visiting order of the samples in ``epoch``."""
        perm = self._perms.get(epoch)
        if perm is None:
            gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            perm = torch.randperm(self.num_samples, generator=gen, device="cpu").tolist()
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def global_indices(self, step: int) -> list[int]:
        """The ``global_batch`` sample indices of optimizer step ``step``."""
        if step < 0:
            raise ValueError(f"step must not be negative, got {step}")
        out: list[int] = []
        pos = step * self.global_batch
        while len(out) < self.global_batch:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(self.global_batch - len(out), self.num_samples - offset)
            out.extend(self.permutation(epoch)[offset : offset + take])
            pos += take
        return out

    def rank_indices(self, step: int) -> list[int]:
        """This rank's contiguous slice of :meth:`global_indices`."""
        start = self.dp_rank * self.per_rank
        return self.global_indices(step)[start : start + self.per_rank]

    def micro_batches(self, step: int, micro_batch: int) -> list[list[int]]:
        """:meth:`rank_indices` split in order into micro-batches of ``micro_batch``."""
        if micro_batch <= 0 or self.per_rank % micro_batch:
            raise ConfigError(
                f"the per-rank batch ({self.per_rank}) must be divisible by the micro-batch "
                f"({micro_batch})."
            )
        mine = self.rank_indices(step)
        return [mine[i : i + micro_batch] for i in range(0, len(mine), micro_batch)]

    def __iter__(self) -> Iterator[list[int]]:
        """Endless :meth:`rank_indices` from :attr:`step` on, advancing :attr:`step`."""
        while True:
            indices = self.rank_indices(self.step)
            self.step += 1
            yield indices

    def state_dict(self) -> dict[str, Any]:
        """The step plus what the order depends on (checked on load)."""
        return {
            "step": self.step,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["step"]``; the data-parallel degree may differ."""
        for key in ("seed", "num_samples", "global_batch"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"cannot resume the data order: the checkpoint has {key}={state[key]} "
                    f"but this run has {key}={getattr(self, key)}."
                )
        self.step = int(state["step"])
