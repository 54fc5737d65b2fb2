"""Prepared folders written directly (no tokenizer, no prepare run) for tests that need a
given token stream or a size no real preparation could make in seconds."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from plait.data.index import DOCUMENTS_NAME, ShardIndex, sha256_file, shard_name

UNCHECKED = "0" * 64
"""The checksum recorded for a sparse shard (opening a folder does not verify them;
``plait data info --verify`` would refuse it)."""


def write_prepared(root: Path, shards: list[np.ndarray | int], ends: list[int]) -> Path:
    """A byte-tokenizer folder (uint16) at ``root``: each shard the given tokens, or an
    int ``n``: a sparse file of ``n`` zero tokens (made without writing a block);
    ``ends`` the documents' end offsets. Returns ``root``."""
    root.mkdir(parents=True)
    entries = []
    for i, shard in enumerate(shards):
        path = root / shard_name(i)
        if isinstance(shard, int):
            with path.open("wb") as f:
                f.truncate(shard * 2)
            entries.append({"file": shard_name(i), "tokens": shard, "sha256": UNCHECKED})
        else:
            np.asarray(shard, dtype=np.uint16).tofile(path)
            entries.append(
                {"file": shard_name(i), "tokens": len(shard), "sha256": sha256_file(path)}
            )
    np.asarray(ends, dtype=np.uint64).tofile(root / DOCUMENTS_NAME)
    sizes = [e["tokens"] for e in entries]
    ShardIndex(
        root,
        "byte",
        256,
        0,
        "uint16",
        max(sizes),
        len(ends),
        sum(sizes),
        entries,
        {"file": DOCUMENTS_NAME, "sha256": sha256_file(root / DOCUMENTS_NAME)},
        {"path": "written by tests", "field": "text"},
    ).write()
    return root
