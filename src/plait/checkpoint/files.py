"""Byte-range access to checkpoint files, and checksums verified once per file per host.

A checkpoint's shard files are safetensors: an 8-byte header length, a JSON header
(each tensor's dtype, shape and ``data_offsets``) and the raw little-endian data. That
layout is what makes rank-local loading possible: :class:`ShardFile` parses the header
once and reads element ranges of a stored tensor with ``os.preadv`` straight into the
destination tensor (no mmap of the whole file, no intermediate copy when the dtypes
match), counting the bytes it read. A resume therefore touches only the byte ranges of
the pieces the rank holds in its new layout.

:func:`verify_collective` checks the sha256 of every file of a checkpoint *once per
host*: the ranks of a host split the files between them (file ``i`` by the host's
``i mod n``-th rank), each streams its files through a bounded buffer, and an
all-gather of one flag per rank tells every rank whether (and which) file is corrupt.
Every rank checks every file's size (a ``stat``) itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import struct
import threading
import zlib
from pathlib import Path
from typing import Any

import torch

from plait import comm
from plait.mesh import Mesh
from plait.pieces import TPSplit, same_split
from plait.train.checkpoint_meta import (
    CheckpointError,
    CorruptCheckpointError,
    global_flat_index,
    sha256_file,
    verify_sizes,
)

READ_CHUNK = 1 << 20
"""Elements per read when a region cannot be read straight into its destination (another
dtype, a device tensor, a change of tensor-parallel degree): the bounded read buffer."""

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class ShardFile:
    """One safetensors file opened for element-range reads.

    ``bytes_read`` counts tensor data read, ``header_bytes`` the header."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"cannot open {path}: {e.strerror or e}") from None
        self.bytes_read = 0
        try:
            raw = os.pread(self.fd, 8, 0)
            (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
            size = os.fstat(self.fd).st_size
            if n < 2 or 8 + n > size:
                raise ValueError("bad header length")
            head: dict[str, Any] = json.loads(os.pread(self.fd, n, 8))
        except (ValueError, UnicodeDecodeError) as e:
            os.close(self.fd)
            raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from None
        self.header_bytes = 8 + n
        self.base = 8 + n
        self.metadata: dict[str, str] = head.pop("__metadata__", None) or {}
        self.entries = head

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def keys(self) -> list[str]:
        return list(self.entries)

    def info(self, key: str) -> tuple[torch.dtype, list[int], int, int]:
        """``(dtype, shape, first byte, end byte)`` of stored tensor ``key``."""
        e = self.entries.get(key)
        if e is None:
            raise CheckpointError(f"{self.path} has no tensor {key!r}")
        dt = _DTYPES.get(e["dtype"])
        if dt is None:
            raise CheckpointError(f"{self.path}: tensor {key!r} has unsupported dtype {e['dtype']}")
        a, b = e["data_offsets"]
        return dt, [int(s) for s in e["shape"]], self.base + int(a), self.base + int(b)

    def numel(self, key: str) -> int:
        dt, _, a, b = self.info(key)
        return (b - a) // _itemsize(dt)

    def read_into(self, key: str, a: int, out: torch.Tensor) -> None:
        """Elements ``[a, a + out.numel())`` of the flattened tensor ``key`` into the
        contiguous CPU tensor ``out`` of the stored dtype (one ``preadv``)."""
        dt, _, first, end = self.info(key)
        size = _itemsize(dt)
        lo = first + a * size
        n = out.numel() * size
        if out.dtype != dt or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("read_into needs a contiguous CPU tensor of the stored dtype")
        if lo + n > end or a < 0:
            raise CheckpointError(f"{self.path}: read past the end of tensor {key!r}")
        if n == 0:
            return
        view = memoryview(out.view(torch.uint8).numpy())  # type: ignore[arg-type]  # (n,) bytes
        done = 0
        while done < n:
            got = os.preadv(self.fd, [view[done:]], lo + done)
            if got <= 0:
                raise CorruptCheckpointError(f"{self.path}: short read (truncated file)")
            done += got
        self.bytes_read += n

    def read(self, key: str, a: int | None = None, b: int | None = None) -> torch.Tensor:
        """Elements ``[a, b)`` of the flattened tensor ``key`` (all of it, in its stored
        shape, when both are None)."""
        dt, shape, _, _ = self.info(key)
        whole = a is None and b is None
        n = self.numel(key)
        a = 0 if a is None else a
        b = n if b is None else b
        out = torch.empty(b - a, dtype=dt)
        self.read_into(key, a, out)
        return out.view(shape) if whole else out


def _itemsize(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt).element_size()


def _host_id() -> float:
    """This host, as a number all ranks can all-gather (crc32 of the host name)."""
    return float(zlib.crc32(socket.gethostname().encode()))


def verify_collective(folder: Path, meta: dict[str, Any], mesh: Mesh) -> list[str]:
    """Collective: check ``folder``'s files, each file's sha256 by one rank per host;
    raises :class:`CorruptCheckpointError` on every rank naming a bad file. Returns the
    files this rank hashed."""
    verify_sizes(folder, meta)
    files = sorted(meta["files"])
    world = mesh.world_size
    if world == 1:
        mine = files
        peers, pos = [0], 0
    else:
        ids = comm.all_gather(torch.tensor([_host_id()], dtype=torch.float64).to(mesh.device),
                              mesh.world())
        assert isinstance(ids, torch.Tensor)
        hosts = ids.cpu().tolist()  # (world,) host id of every rank
        peers = [r for r in range(world) if hosts[r] == hosts[mesh.rank]]
        pos = peers.index(mesh.rank)
        mine = [f for i, f in enumerate(files) if i % len(peers) == pos]
    bad = -1.0
    for name in mine:
        if sha256_file(folder / name) != meta["files"][name]["sha256"]:
            bad = float(files.index(name))
            break
    if world > 1:
        out = comm.all_gather(torch.tensor([bad], dtype=torch.float64).to(mesh.device),
                              mesh.world())
        assert isinstance(out, torch.Tensor)
        flags = out.cpu().tolist()  # (world,) first bad file index per rank, -1: none
    else:
        flags = [bad]
    hits = [(int(f), r) for r, f in enumerate(flags) if f >= 0]
    if hits:
        i, r = min(hits)
        raise CorruptCheckpointError(
            f"checkpoint {folder}: shard file {files[i]} fails its checksum (sha256 checked "
            f"by rank {r}): the file is corrupt"
        )
    return mine


# ---------------------------------------------------------------------------- regions

RUN_GAP = 4096
"""Under a change of tensor-parallel degree, runs of wanted elements of a saved piece
closer than this many elements are read as one range (fewer, larger reads)."""


def _unravel(flat: torch.Tensor, shape: list[int] | tuple[int, ...]) -> list[torch.Tensor]:
    coords = []
    rest = flat
    for size in reversed(shape):
        coords.append(rest % size)
        rest = rest // size
    coords.reverse()
    return coords


def local_flat_index(shape: list[int], tp: TPSplit | None, g: torch.Tensor) -> torch.Tensor:
    """The flat position within tensor-parallel block ``tp`` of each global flat index
    ``g`` (``(n,)`` int64, all valid), or -1 where the element is outside the block."""
    if tp is None:
        return g
    coords = _unravel(g, shape)
    along = coords[tp.dim] - (tp.index // tp.replicas) * tp.block
    inside = (along >= 0) & (along < tp.block)
    coords[tp.dim] = along.clamp(0, max(0, tp.block - 1))
    flat = torch.zeros_like(g)
    for c, size in zip(coords, tp.local_shape(tuple(shape)), strict=True):
        flat = flat * size + c
    flat[~inside] = -1
    return flat


def _copy_range(f: ShardFile, key: str, off: int, dst: torch.Tensor) -> None:
    """Elements ``[off, off + dst.numel())`` of stored ``key`` into ``dst`` (1-D)."""
    dt = f.info(key)[0]
    if dst.dtype == dt and dst.device.type == "cpu" and dst.is_contiguous():
        f.read_into(key, off, dst)  # straight into the destination
        return
    n = dst.numel()
    buf = torch.empty(min(n, READ_CHUNK), dtype=dt)  # the bounded read buffer
    for i in range(0, n, READ_CHUNK):
        m = min(READ_CHUNK, n - i)
        f.read_into(key, off + i, buf[:m])
        dst[i : i + m].copy_(buf[:m])


def read_region(
    reader: Any, name: str, kind: str, tp: TPSplit | None, start: int, out: torch.Tensor
) -> None:
    """``out.numel()`` values of ``kind`` of parameter ``name`` at elements ``[start,
    start + n)`` of block ``tp`` into ``out`` (:meth:`CheckpointReader.read_into`).

    Saved pieces of the same block covering the range: only their overlapping byte
    ranges are read. Otherwise (another tensor-parallel degree) each saved piece is
    walked in chunks of :data:`READ_CHUNK` elements, the global position of each element
    computed, and only the runs of elements that fall into the region are read."""
    e = reader.entry(name)
    n = out.numel()
    end = start + n
    pieces = []
    seen_ranges: set[tuple[Any, int, int]] = set()
    for p in e.pieces:
        if kind not in p.keys:
            raise CheckpointError(f"checkpoint {reader.folder}: {name} has no {kind!r} state")
        block = None if p.tp is None else (*p.tp.to_json()[:5], p.tp.index // p.tp.replicas)
        ident = (block, p.start, p.end)
        if ident not in seen_ranges:  # a replica written twice is read once
            seen_ranges.add(ident)
            pieces.append(p)
    same = [p for p in pieces if same_split(p.tp, tp) and p.start < end and p.end > start]
    if sum(min(end, p.end) - max(start, p.start) for p in same) == n:
        for p in same:
            a, b = max(start, p.start), min(end, p.end)
            _copy_range(reader._file(p.file), p.keys[kind], a - p.start, out[a - start : b - start])
        return
    shape = e.shape
    out.zero_()  # tensor-parallel padding reads as zero
    seen = torch.zeros(n, dtype=torch.bool)  # (n,) elements of the region filled
    want = 0
    for q0 in range(start, end, READ_CHUNK):
        want += int((global_flat_index(shape, tp, q0, min(end, q0 + READ_CHUNK)) >= 0).sum())
    for p in pieces:
        f = reader._file(p.file)
        key = p.keys[kind]
        dt = f.info(key)[0]
        for q0 in range(p.start, p.end, READ_CHUNK):
            q1 = min(p.end, q0 + READ_CHUNK)
            g = global_flat_index(shape, p.tp, q0, q1)  # (q1 - q0,) global positions
            r = torch.full_like(g, -1)
            valid = g >= 0
            r[valid] = local_flat_index(shape, tp, g[valid])  # positions in the region's block
            mask = (r >= start) & (r < end)
            pos = mask.nonzero().squeeze(1)
            if pos.numel() == 0:
                continue
            cut = ((pos[1:] - pos[:-1]) > RUN_GAP).nonzero().squeeze(1)
            firsts = [int(pos[0]), *(int(x) for x in pos[cut + 1])]
            lasts = [*(int(x) + 1 for x in pos[cut]), int(pos[-1]) + 1]
            for ra, rb in zip(firsts, lasts, strict=True):
                buf = torch.empty(rb - ra, dtype=dt)  # at most READ_CHUNK elements
                f.read_into(key, q0 - p.start + ra, buf)
                m = mask[ra:rb]
                at = r[ra:rb][m] - start
                out[at.to(out.device)] = buf[m].to(out.device, out.dtype)
                seen[at] = True
    got = int(seen.sum())
    if got < want:
        raise CheckpointError(
            f"checkpoint {reader.folder}: tensor {name!r} ({kind}) is incomplete: "
            f"{want - got} of the {want} elements this rank needs are in no shard file"
        )


# ---------------------------------------------------------------------------- writing

_NAMES = {dt: name for name, dt in _DTYPES.items()}


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The raw bytes of contiguous CPU tensor ``t`` (no copy)."""
    flat = t.reshape(-1)  # a view: t is contiguous
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[str, int]:
    """Write ``tensors`` (CPU) as a safetensors file straight from their memory (no
    serialized copy), fsynced; the sha256 is computed on a second thread while the
    file is written (hashlib and large writes release the GIL). Returns ``(sha256,
    bytes)``."""
    parts: list[memoryview] = []
    head: dict[str, Any] = {}
    at = 0
    for key in sorted(tensors):
        t = tensors[key]
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.to("cpu").contiguous()
        name = _NAMES.get(t.dtype)
        if name is None:
            raise CheckpointError(f"cannot store tensor {key!r} of dtype {t.dtype}")
        mv = _bytes_of(t)
        head[key] = {"dtype": name, "shape": list(t.shape), "data_offsets": [at, at + mv.nbytes]}
        parts.append(mv)
        at += mv.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    parts.insert(0, memoryview(struct.pack("<Q", len(raw)) + raw))
    digest = hashlib.sha256()

    def _hash() -> None:
        for mv in parts:
            digest.update(mv)

    hasher = threading.Thread(target=_hash, name="plait-sha256")
    hasher.start()
    try:
        with path.open("wb", buffering=0) as f:
            for mv in parts:
                done = 0
                while done < mv.nbytes:
                    done += f.write(mv[done:]) or 0
            os.fsync(f.fileno())
    finally:
        hasher.join()
    return digest.hexdigest(), sum(mv.nbytes for mv in parts)
