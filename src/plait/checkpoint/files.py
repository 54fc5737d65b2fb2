"""The bytes of a checkpoint: safetensors read by byte range and written from memory,
durable writes, and checksums verified once per file per host.

A checkpoint's shard files are safetensors: an 8-byte header length, a JSON header
(each tensor's dtype, shape and ``data_offsets``) and the raw little-endian data. That
layout is what makes rank-local loading possible: :class:`ShardFile` parses the header
once and reads element ranges of a stored tensor with ``os.preadv`` straight into the
destination tensor (no mmap of the whole file, no intermediate copy when the dtypes
match), counting the bytes it read. A resume therefore touches only the byte ranges of
the pieces the rank holds in its new layout. :func:`write_safetensors` writes a rank's
file straight from the tensors' memory, hashing it on a second thread.

:func:`verify_collective` checks the sha256 of every file of a checkpoint *once per
host*: the ranks of a host split the files between them (file ``i`` by the host's
``i mod n``-th rank), each streams its files through a bounded buffer, and an
all-gather of one flag per rank tells every rank whether (and which) file is corrupt.
Every rank checks every file's size (a ``stat``) itself. :func:`verify_files` checks
every file in one process.
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
from plait.checkpoint.format import CheckpointError, CorruptCheckpointError
from plait.mesh import Mesh

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


# ---------------------------------------------------------------------------- writing


_NAMES = {dt: name for name, dt in _DTYPES.items()}


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The raw bytes of contiguous CPU tensor ``t`` (no copy)."""
    flat = t.reshape(-1)  # a view: t is contiguous
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def safetensors_parts(tensors: dict[str, torch.Tensor]) -> list[memoryview]:
    """The bytes of a safetensors file of ``tensors``, in order: the header, then each
    tensor's memory (no copy of a contiguous CPU tensor)."""
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
    return parts


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[str, int]:
    """Write ``tensors`` (CPU) as a safetensors file straight from their memory (no
    serialized copy), fsynced; the sha256 is computed on a second thread while the
    file is written (hashlib and large writes release the GIL). Returns ``(sha256,
    bytes)``."""
    parts = safetensors_parts(tensors)
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


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (new, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the caller fsyncs the folder)."""
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_durable(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` by a file holding ``data`` (write, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    write_durable(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


# ---------------------------------------------------------------------------- checksums


def verify_sizes(folder: Path, meta: dict[str, Any]) -> None:
    """Every file exists with the size the metadata records (a ``stat`` each)."""
    for name, info in meta["files"].items():
        path = folder / name
        if not path.is_file():
            raise CorruptCheckpointError(f"checkpoint {folder}: shard file {name} is missing")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise CorruptCheckpointError(
                f"checkpoint {folder}: shard file {name} has {size} bytes, the metadata "
                f"says {info['bytes']} (truncated or overwritten)"
            )


def verify_files(folder: Path, meta: dict[str, Any]) -> None:
    """Check every shard file's size and sha256 against the metadata."""
    verify_sizes(folder, meta)
    for name, info in meta["files"].items():
        path = folder / name
        digest = sha256_file(path)
        if digest != info["sha256"]:
            raise CorruptCheckpointError(
                f"checkpoint {folder}: shard file {name} fails its checksum (sha256 "
                f"{digest[:16]}..., expected {info['sha256'][:16]}...): the file is corrupt"
            )


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
        ids = comm.all_gather(
            torch.tensor([_host_id()], dtype=torch.float64).to(mesh.device), mesh.world()
        )
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
        out = comm.all_gather(
            torch.tensor([bad], dtype=torch.float64).to(mesh.device), mesh.world()
        )
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
