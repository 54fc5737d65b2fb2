"""Reading any layout's pieces out of a checkpoint written under another layout.

A rank of the new layout asks for a *region* of a parameter (or of one of its optimizer
states): its tensor-parallel block (or the whole tensor) and an element range of it,
exactly the description :mod:`plait.checkpoint.format` stores for every saved
piece. :meth:`CheckpointReader.read_into` answers it with byte-range reads of the shard
files (:class:`~plait.checkpoint.files.ShardFile`), never more than the region needs:

* directly, when saved pieces of the very same block cover the range: only the
  overlapping byte ranges of those pieces are read, straight into the destination —
  same tp layout, any dp degree, ZeRO stage or pipeline split;
* otherwise (a change of tensor-parallel degree) each saved piece is walked in bounded
  chunks, each element's global position computed
  (:func:`~plait.checkpoint.format.global_flat_index`, padding dropped), and only
  the runs of elements that fall into the region are read.

Every element of the region must be covered by a saved piece, or the read is refused
naming the tensor. Also here: :func:`consolidate`, which writes the whole model into one
safetensors file with one-device names (what ``plait checkpoint consolidate`` does: the
one place the whole model is assembled).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from plait.checkpoint.files import ShardFile, verify_files, write_durable
from plait.checkpoint.format import (
    CheckpointError,
    ParamEntry,
    Piece,
    dtype_from_name,
    dtype_to_name,
    global_flat_index,
    params_of,
    read_metadata,
)
from plait.pieces import TPSplit, same_split

READ_CHUNK = 1 << 20
"""Elements per read when a region cannot be read straight into its destination (another
dtype, a device tensor, a change of tensor-parallel degree): the bounded read buffer."""

RUN_GAP = 4096
"""Under a change of tensor-parallel degree, runs of wanted elements of a saved piece
closer than this many elements are read as one range (fewer, larger reads)."""


class CheckpointReader:
    """Random access to the pieces of one checkpoint folder (or, through
    :meth:`from_weights_file`, of a consolidated weights file).

    Reads are byte ranges of the shard files (:class:`~plait.checkpoint.files.
    ShardFile`); :attr:`bytes_read` counts the tensor data read. ``verify`` checks every
    file's sha256 first (:class:`CorruptCheckpointError`); a resume verifies collectively
    instead (:func:`~plait.checkpoint.files.verify_collective`: once per file per host).
    """

    def __init__(self, folder: str | Path, verify: bool = True) -> None:
        self.folder = Path(folder)
        self.meta = read_metadata(self.folder)
        if verify:
            verify_files(self.folder, self.meta)
        self.params: dict[str, ParamEntry] = params_of(self.meta)
        self._files: dict[str, ShardFile] = {}
        self._cache: dict[tuple[str, str], torch.Tensor] = {}

    @classmethod
    def from_weights_file(cls, path: str | Path) -> CheckpointReader:
        """A consolidated safetensors file (one-device names, whole tensors) seen as a
        checkpoint with one piece per tensor and no optimizer state."""
        p = Path(path)
        f = ShardFile(p)
        self = cls.__new__(cls)
        self.folder = p.parent
        self.meta = {"step": 0}
        self.params = {}
        for key in f.entries:
            dt, shape, _, _ = f.info(key)
            name = dtype_to_name(dt)
            piece = Piece(p.name, 0, f.numel(key), None, {"param": key})
            self.params[key] = ParamEntry(shape, name, name, [piece])
        self._files = {p.name: f}
        self._cache = {}
        return self

    @property
    def step(self) -> int:
        """Optimizer steps done when the checkpoint was written."""
        return int(self.meta["step"])

    @property
    def bytes_read(self) -> int:
        """Tensor data read from the files so far (headers and checksums not counted)."""
        return sum(f.bytes_read for f in self._files.values())

    def close(self) -> None:
        """Close the open files (the reader can still open them again)."""
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._cache.clear()

    def _file(self, name: str) -> ShardFile:
        f = self._files.get(name)
        if f is None:
            f = ShardFile(self.folder / name)
            self._files[name] = f
        return f

    def tensor(self, file: str, key: str) -> torch.Tensor:
        """One stored tensor (whole)."""
        return self._file(file).read(key)

    def entry(self, name: str) -> ParamEntry:
        e = self.params.get(name)
        if e is None:
            raise CheckpointError(f"checkpoint {self.folder} has no tensor {name!r}")
        return e

    def kinds(self, name: str) -> list[str]:
        """The stored kinds of a parameter: "param" and its per-element optimizer states."""
        e = self.entry(name)
        return list(e.pieces[0].keys) if e.pieces else []

    def read(self, name: str, kind: str, tp: TPSplit | None, start: int, end: int) -> torch.Tensor:
        """``(end - start,)`` values of ``kind`` ("param", "exp_avg", ...) of parameter
        ``name`` at elements ``[start, end)`` of tensor-parallel block ``tp`` (None: the
        whole tensor, flattened), in the stored dtype (tp padding reads as zero)."""
        out = torch.empty(end - start, dtype=dtype_from_name(self.entry(name).dtype))
        self.read_into(name, kind, tp, start, out)
        return out

    def read_into(
        self, name: str, kind: str, tp: TPSplit | None, start: int, out: torch.Tensor
    ) -> None:
        """Like :meth:`read`, into ``out`` (``(n,)``, any dtype and device, contiguous):
        only the byte ranges that hold the region are read, straight into ``out`` when
        it is a CPU tensor of the stored dtype, else through a bounded buffer."""
        read_region(self, name, kind, tp, start, out)

    def read_global(self, name: str, kind: str = "param") -> torch.Tensor:
        """The whole global tensor (``shape``) of ``kind`` of ``name``, from every piece."""
        key = (name, kind)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        e = self.entry(name)
        flat = torch.zeros(e.numel, dtype=dtype_from_name(e.dtype))
        seen = torch.zeros(e.numel, dtype=torch.bool)
        for p in e.pieces:
            if kind not in p.keys:
                raise CheckpointError(f"checkpoint {self.folder}: {name} has no {kind!r} state")
            data = self.tensor(p.file, p.keys[kind]).reshape(-1)  # (piece numel,)
            idx = global_flat_index(e.shape, p.tp, p.start, p.end)
            valid = idx >= 0
            flat[idx[valid]] = data[valid].to(flat.dtype)
            seen[idx[valid]] = True
        if not bool(seen.all()):
            missing = int((~seen).sum())
            raise CheckpointError(
                f"checkpoint {self.folder}: tensor {name!r} ({kind}) is incomplete: "
                f"{missing} of {e.numel} elements are in no shard file"
            )
        out = flat.view(e.shape)
        if len(self._cache) > 8:
            self._cache.clear()
        self._cache[key] = out
        return out

    def scalar(self, name: str, state: str) -> torch.Tensor | None:
        """A 0-dim optimizer state (AdamW's ``step``) of ``name``; None if not saved."""
        for p in self.entry(name).pieces:
            if state in p.scalars:
                return self.tensor(p.file, p.scalars[state])
        return None

    def scalar_names(self, name: str) -> list[str]:
        e = self.entry(name)
        return list(e.pieces[0].scalars) if e.pieces else []

    def model_state(self) -> dict[str, torch.Tensor]:
        """Every parameter as a whole tensor with its one-device name (stored dtype)."""
        return {name: self.read_global(name) for name in self.params}


# ---------------------------------------------------------------------------- regions


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


# ---------------------------------------------------------------------------- the whole model


def consolidate(source: str | Path | CheckpointReader, out: str | Path) -> dict[str, Any]:
    """Write the whole model of checkpoint ``source`` (a folder, or a reader already
    opened and verified) into the safetensors file ``out`` (one-device names, the stored
    dtype: fp32 masters where they existed); returns a summary (step, tensors,
    parameters, bytes)."""
    reader = source if isinstance(source, CheckpointReader) else CheckpointReader(source)
    folder = reader.folder
    state = {k: v.contiguous() for k, v in reader.model_state().items()}
    meta = {
        "format": "plait-consolidated",
        "step": str(reader.step),
        "source": str(Path(folder).resolve()),
        "config": json.dumps(reader.meta.get("config", {})),
    }
    data = st_save(state, metadata=meta)
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    try:
        write_durable(tmp, data)
        tmp.replace(out_path)
    except OSError as e:
        tmp.unlink(missing_ok=True)  # never leave the temporary file behind
        raise CheckpointError(f"cannot write {out_path}: {e.strerror or e}") from None
    return {
        "step": reader.step,
        "tensors": len(state),
        "parameters": sum(t.numel() for t in state.values()),
        "bytes": len(data),
    }
