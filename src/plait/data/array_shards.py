"""Fixed-size shard files of one array stream (tokens, or their loss mask), written in
order: each shard to a temporary name, then renamed; :meth:`ArrayShards.close` returns
the index entries (``file``, ``tokens``, ``sha256``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from plait.data.index import sha256_file
from plait.data.writer import write_atomic


class ArrayShards:
    """Cuts a stream of ``dtype`` values into files ``{prefix}_NNNNN.bin`` of ``size``."""

    def __init__(self, out: Path, prefix: str, size: int, dtype: str) -> None:
        self.out, self.prefix, self.size = out, prefix, size
        self.buf = np.empty(size, dtype=np.dtype(dtype))
        self.fill = 0
        self.entries: list[dict[str, Any]] = []

    def add(self, values: np.ndarray) -> None:
        """Append ``values`` (cast to the stream's dtype)."""
        while len(values):
            take = min(len(values), self.size - self.fill)
            self.buf[self.fill : self.fill + take] = values[:take]
            self.fill += take
            values = values[take:]
            if self.fill == self.size:
                self._flush()

    def _flush(self) -> None:
        if self.fill == 0:
            return
        path = self.out / f"{self.prefix}_{len(self.entries):05d}.bin"
        write_atomic(path, self.buf[: self.fill].tobytes())
        self.entries.append({"file": path.name, "tokens": self.fill, "sha256": sha256_file(path)})
        self.fill = 0

    def close(self) -> list[dict[str, Any]]:
        """Write the last (short) shard; the entries of every shard."""
        self._flush()
        return self.entries
