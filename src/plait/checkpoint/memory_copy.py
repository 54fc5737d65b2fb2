"""In-memory checkpoint copies (``train.memory_checkpoint_every``): each rank's pieces
in its own and in a buddy rank's host memory.

At a copy every rank (collective over the world, at a step boundary) takes the same
snapshot a disk save takes (:func:`~plait.checkpoint.write.snapshot`: pieces, optimizer
state, RNG, rank 0's header), serialises it as the checkpoint's safetensors bytes and
index, and sends them to its buddy (:func:`~plait.checkpoint.memory_store.buddy_of`)
while receiving its ward's, through :func:`plait.comm.batch_isend_irecv` (counted: per
rank 8 bytes of length plus the index and file bytes, :func:`copy_bytes`). Both copies
go into the :class:`~plait.checkpoint.memory_store.MemoryStore`. The exchange is
synchronous: it is one point-to-point message pair per rank and costs a memory copy's
bandwidth, not a disk's.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import torch

from plait import comm
from plait.checkpoint.files import safetensors_parts, sha256_bytes
from plait.checkpoint.format import json_bytes
from plait.checkpoint.memory_store import MemoryStore, buddy_of, ward_of
from plait.checkpoint.state import TrainState
from plait.checkpoint.write import snapshot
from plait.mesh import Mesh

COPY_TAG = 4343
"""The point-to-point tag of the copies (apart from any other message)."""


@dataclass(frozen=True)
class CopyReport:
    """One memory copy on this rank."""

    step: int
    sent_bytes: int
    """Bytes sent to the buddy (length header, index, file)."""
    held_bytes: int
    """Host memory this rank's store folder holds after it (own and ward's copy)."""
    seconds: float


def serialise(ts: TrainState, step: int) -> tuple[bytes, bytes]:
    """(index JSON, safetensors bytes) of this rank's checkpoint part of ``step``; rank
    0's index carries the checkpoint's header and parameter order."""
    snap = snapshot(ts, step, copy=True)
    file = b"".join(safetensors_parts(snap.tensors))
    index = {**snap.index, "checksum": {"sha256": sha256_bytes(file), "bytes": len(file)}}
    if snap.header is not None:
        index["header"], index["order"] = snap.header, snap.order
    return json_bytes(index), file


def copy_bytes(index: bytes, file: bytes) -> int:
    """Bytes one rank sends per copy: an 8-byte length, then the index and the file."""
    return 8 + 8 + len(index) + len(file)


def memory_copy(ts: TrainState, step: int, store: MemoryStore, per_node: int) -> CopyReport:
    """Collective over the world: this rank's copy to its buddy and its own store, its
    ward's copy from the ward (see the module docstring)."""
    t0 = time.perf_counter()
    mesh: Mesh = ts.mesh
    world, rank = mesh.world_size, mesh.rank
    index, file = serialise(ts, step)
    blob = struct.pack("<Q", len(index)) + index + file
    buddy, ward = buddy_of(rank, world, per_node), ward_of(rank, world, per_node)
    group = mesh.world()
    size_out = torch.tensor([len(blob)], dtype=torch.int64)
    size_in = torch.zeros(1, dtype=torch.int64)
    for h in comm.batch_isend_irecv(
        [comm.P2P("send", size_out, buddy, COPY_TAG), comm.P2P("recv", size_in, ward, COPY_TAG)],
        group,
    ):
        h.wait()
    out = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    got = torch.empty(int(size_in.item()), dtype=torch.uint8)
    for h in comm.batch_isend_irecv(
        [comm.P2P("send", out, buddy, COPY_TAG), comm.P2P("recv", got, ward, COPY_TAG)], group
    ):
        h.wait()
    raw = got.numpy().tobytes()
    (n,) = struct.unpack("<Q", raw[:8])
    store.put(rank, rank, step, index, file)
    store.put(rank, ward, step, raw[8 : 8 + n], raw[8 + n :])
    store.complete(rank, step)
    return CopyReport(step, 8 + len(blob), store.held_bytes(rank), time.perf_counter() - t0)
