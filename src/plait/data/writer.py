"""Writing the shards of ``plait data prepare``: each shard to a temporary name, renamed,
then its sidecar ``shard_NNNNN.json`` (tokens, SHA-256, the end offsets of the documents
that end in it); and, when a run resumes, the contiguous prefix of finished shards that
verify (everything after it is removed and written again).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np

from plait.data.index import sha256_file, shard_name

KILL_AFTER_ENV = "PLAIT_TEST_PREPARE_KILL_AFTER"
"""Test hook: SIGKILL the preparing process after this many shards were written."""


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def sidecar_path(out: Path, i: int) -> Path:
    return out / shard_name(i).replace(".bin", ".json")


def kept_shards(out: Path, shard_tokens: int, item: int) -> list[dict[str, Any]]:
    """Sidecars of the contiguous prefix of finished, verified shards; later files removed."""
    kept: list[dict[str, Any]] = []
    i = 0
    while True:
        side, shard = sidecar_path(out, i), out / shard_name(i)
        try:
            meta = json.loads(side.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            break
        if (
            not shard.is_file()
            or meta.get("tokens") != shard_tokens
            or shard.stat().st_size != shard_tokens * item
            or sha256_file(shard) != meta.get("sha256")
        ):
            break
        kept.append(meta)
        i += 1
    for p in out.iterdir():  # whatever follows the prefix is rewritten
        if p.name.startswith("shard_") and (p.suffix == ".tmp" or int(p.name[6:11]) >= i):
            p.unlink()
    return kept


class ShardWriter:
    """Cuts the token stream into shards (see the module's docstring)."""

    def __init__(self, out: Path, shard_tokens: int, dtype: str, first: int, at: int) -> None:
        self.out, self.n, self.dtype = out, shard_tokens, np.dtype(dtype)
        self.buf = np.empty(shard_tokens, dtype=self.dtype)
        self.fill = 0
        self.index = first  # next shard's number
        self.pos = at  # tokens written before the buffer
        self.doc_ends: list[int] = []  # documents ending in the buffer
        self.kill_after = int(os.environ.get(KILL_AFTER_ENV, "0"))

    def add(self, tokens: np.ndarray, lengths: np.ndarray, skip: int) -> None:
        """Append a batch (its first ``skip`` tokens already written by an earlier run)."""
        ends = self.pos + self.fill - skip + np.cumsum(lengths)
        tokens = tokens[skip:]
        end_list = ends.tolist()
        while len(tokens):
            take = min(len(tokens), self.n - self.fill)
            self.buf[self.fill : self.fill + take] = tokens[:take]
            self.fill += take
            tokens = tokens[take:]
            top = self.pos + self.fill
            while end_list and end_list[0] <= top:
                self.doc_ends.append(int(end_list.pop(0)))
            if self.fill == self.n:
                self.flush()

    def flush(self) -> None:
        """Write the buffer as the next shard (temp name, rename), then its sidecar."""
        if self.fill == 0:
            return
        shard = self.out / shard_name(self.index)
        write_atomic(shard, self.buf[: self.fill].tobytes())
        meta = {"tokens": self.fill, "sha256": sha256_file(shard), "doc_ends": self.doc_ends}
        write_atomic(sidecar_path(self.out, self.index), json.dumps(meta).encode())
        self.pos += self.fill
        self.index += 1
        self.fill, self.doc_ends = 0, []
        if self.kill_after and self.index >= self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
