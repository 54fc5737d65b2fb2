"""Reading any layout's pieces out of a checkpoint written under another layout.

A rank of the new layout asks for a *region* of a parameter (or of one of its optimizer
states): its tensor-parallel block (or the whole tensor) and an element range of it,
exactly the description :mod:`plait.train.checkpoint_meta` stores for every saved
piece. :meth:`CheckpointReader.read_into` answers it with byte-range reads of the shard
files (:mod:`plait.train.checkpoint_io`), never more than the region needs:

* directly, when saved pieces of the very same block cover the range: only the
  overlapping byte ranges of those pieces are read, straight into the destination —
  same tp layout, any dp degree, ZeRO stage or pipeline split;
* otherwise (a change of tensor-parallel degree) each saved piece is walked in bounded
  chunks, each element's global position computed
  (:func:`~plait.train.checkpoint_meta.global_flat_index`, padding dropped), and only
  the runs of elements that fall into the region are read.

Every element of the region must be covered by a saved piece, or the read is refused
naming the tensor. Also here: :func:`find_checkpoint` (which checkpoint a resume reads,
with the fallback past a corrupt one), :func:`check_model` (refusing a checkpoint whose
tensors do not match the model, by name), :func:`restore_rng`, and :func:`consolidate`,
which writes the whole model into one safetensors file with one-device names (what
``plait checkpoint consolidate`` does: the one place the whole model is assembled).
"""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as st_save
from torch import nn

from plait.pieces import TPSplit
from plait.train.checkpoint_io import ShardFile, read_region
from plait.train.checkpoint_meta import (
    LATEST,
    METADATA,
    CheckpointError,
    ParamEntry,
    Piece,
    dtype_from_name,
    dtype_to_name,
    global_flat_index,
    list_steps,
    params_of,
    read_latest,
    read_metadata,
    verify_files,
    write_durable,
)


class CheckpointReader:
    """Random access to the pieces of one checkpoint folder (or, through
    :meth:`from_weights_file`, of a consolidated weights file).

    Reads are byte ranges of the shard files (:class:`~plait.train.checkpoint_io.
    ShardFile`); :attr:`bytes_read` counts the tensor data read. ``verify`` checks every
    file's sha256 first (:class:`CorruptCheckpointError`); a resume verifies collectively
    instead (:func:`~plait.train.checkpoint_io.verify_collective`: once per file per host).
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


def find_checkpoint(
    spec: str,
    root: Path | None,
    announce: bool = True,
    verify: Callable[[Path, dict[str, Any]], Any] | None = None,
) -> CheckpointReader | None:
    """The checkpoint to resume from, verified.

    ``spec`` is "latest" (what ``root/latest`` names; if that one is missing or corrupt,
    the newest usable older one, with a warning), "auto" (the same, but None when
    ``root`` holds no checkpoint at all), or a path: a checkpoint folder (no fallback)
    or a checkpoint root (as "latest"). ``announce``: issue the fallback warning here.
    ``verify(folder, meta)``: how to check a candidate's files (default: every file's
    sha256 here; a resume passes the collective check, once per file per host).
    """

    def _open(folder: Path) -> CheckpointReader:
        if verify is None:
            return CheckpointReader(folder)
        reader = CheckpointReader(folder, verify=False)
        verify(folder, reader.meta)
        return reader

    if spec not in ("latest", "auto"):
        p = Path(spec)
        if p.is_dir() and not (p / METADATA).exists() and (read_latest(p) or list_steps(p)):
            return find_checkpoint("latest", p, announce, verify)
        if not p.exists():
            raise CheckpointError(f"no checkpoint at {p}")
        return _open(p)
    if root is None:
        raise CheckpointError(f"resume = {spec!r} needs train.checkpoint_dir")
    pointed = read_latest(root)
    candidates = [pointed] if pointed is not None else []
    candidates += [p for _, p in reversed(list_steps(root)) if p != pointed]
    if not candidates:
        if spec == "auto":
            return None
        raise CheckpointError(
            f"there is no checkpoint in {root} to resume from; start without --resume (or "
            "with train.resume = 'auto', which starts fresh when there is none)"
        )
    problems: list[str] = []
    for folder in candidates:
        try:
            reader = _open(folder)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if announce and (problems or pointed is None):
            why = "; ".join(problems) if problems else f"{root}/{LATEST} is missing"
            warnings.warn(
                f"resuming from {folder.name} instead of the latest checkpoint: {why}",
                RuntimeWarning,
                stacklevel=2,
            )
        return reader
    raise CheckpointError(f"no usable checkpoint in {root}: " + "; ".join(problems))


def check_model(reader_params: dict[str, list[int]], model: nn.Module, source: str) -> None:
    """Refuse a checkpoint whose tensors do not match ``model``'s, naming the tensor."""
    have = {n: list(p.shape) for n, p in model.named_parameters()}
    for name, shape in have.items():
        if name not in reader_params:
            raise CheckpointError(
                f"{source} does not match the model: it has no tensor {name!r} (shape "
                f"{shape}); was it written for another model configuration?"
            )
        if reader_params[name] != shape:
            raise CheckpointError(
                f"{source} does not match the model: tensor {name!r} has shape "
                f"{reader_params[name]} in the checkpoint but {shape} in the model"
            )
    extra = [n for n in reader_params if n not in have]
    if extra:
        raise CheckpointError(
            f"{source} does not match the model: it holds tensor {extra[0]!r}"
            f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''} the model does not have"
        )


def restore_rng(reader: CheckpointReader, rank: int, device: torch.device) -> None:
    """Set this rank's RNG states from the checkpoint (rank r of another world size
    takes saved rank r mod the old world size)."""
    ranks = reader.meta["ranks"]
    r = ranks[rank % len(ranks)]  # another world size: reuse the states cyclically
    f = r["file"]
    torch.set_rng_state(reader.tensor(f, "rng/torch"))
    if device.type == "cuda" and "rng/cuda" in r.get("keys", []):
        torch.cuda.set_rng_state(reader.tensor(f, "rng/cuda"), device)
    version, gauss = r["rng"]["python"]
    py_state = tuple(int(x) for x in reader.tensor(f, "rng/python").tolist())
    random.setstate((version, py_state, gauss))
    name, pos, has_gauss, cached = r["rng"]["numpy"]
    keys = reader.tensor(f, "rng/numpy").numpy().astype(np.uint32)
    np.random.set_state((name, keys, pos, has_gauss, cached))
