"""What a checkpoint is on disk: its folder and file names, and the tensor index.

A checkpoint is one folder::

    step_00000010/
        metadata.json            everything below, plus the config, layout and checksums
        rank00000.safetensors    the pieces rank 0 holds (and its RNG states)
        rank00001.safetensors    ...

Every model parameter is described once, by its one-device name (``layers.0.attention.
wq.weight``), with its global shape and stored dtype, and a list of *pieces*. A piece is
what one rank held: the tensor-parallel block of the parameter it had (:class:`TPSplit`,
the ``dim``/``block`` arithmetic of a tensor-parallel layout; None for the
whole tensor) and the element range ``[start, end)`` of that block, flattened (a ZeRO
flat-shard segment; the whole block without ZeRO). A pipeline stage simply has pieces of
its own layers only. The optimizer state of a piece (AdamW's ``exp_avg``,
``exp_avg_sq``; its scalar ``step``) is stored under the same piece, so it lives in the
same global index space and any other layout can cut out what it needs
(:mod:`plait.checkpoint.read`). Replicas (data-parallel copies, replicated tensor-parallel
tensors) are written once.

While a save is in flight the folder is ``.tmp-step_00000010`` and each rank adds its
index ``rank<r>.json`` (its pieces, its file's sha256 and size) once its file is written;
rank 0 merges the indexes into ``metadata.json`` and renames the folder into place. The
``latest`` file of the checkpoint root names the newest complete checkpoint.

Files are safetensors (no pickled code can run on load, :mod:`plait.checkpoint.files`)
whose sha256 is recorded in ``metadata.json``; a truncated or altered file is refused
with its name.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from plait.errors import ConfigError
from plait.pieces import TPSplit

FORMAT = "plait-checkpoint"


VERSION = 1


METADATA = "metadata.json"


LATEST = "latest"


STEP_PREFIX = "step_"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: missing, corrupt, or not matching the model."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is missing, truncated or altered (its sha256 does not match)."""


def step_dirname(step: int) -> str:
    """``step_00000010`` for step 10."""
    return f"{STEP_PREFIX}{step:08d}"


def rank_filename(rank: int) -> str:
    """``rank00003.safetensors`` for rank 3."""
    return f"rank{rank:05d}.safetensors"


def index_name(rank: int) -> str:
    return f"rank{rank:05d}.json"


def folders(root: Path, step: int) -> tuple[Path, Path]:
    """``(final, temporary)`` folder of the checkpoint of ``step``."""
    final = root / step_dirname(step)
    return final, root / f".tmp-{final.name}"


@dataclass
class Piece:
    """One rank's piece of one parameter: its block, element range, and stored keys."""

    file: str
    start: int
    end: int
    tp: TPSplit | None = None
    keys: dict[str, str] = field(default_factory=dict)  # kind -> safetensors key
    """``"param"`` (the values; fp32 masters where they exist) and each per-element
    optimizer state (``"exp_avg"``, ...), each a ``(end - start,)`` tensor."""
    # name -> key of a state tensor of the whole parameter, the same in every piece: a
    # 0-dim scalar (``step``) or a small tensor not shaped like the piece (Adafactor's
    # row and column factors), read whole by every piece of any layout
    scalars: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tp"] = self.tp.to_json() if self.tp is not None else None
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> Piece:
        return Piece(
            file=str(d["file"]),
            start=int(d["start"]),
            end=int(d["end"]),
            tp=TPSplit.from_json(d.get("tp")),
            keys=dict(d.get("keys", {})),
            scalars=dict(d.get("scalars", {})),
        )


@dataclass
class ParamEntry:
    """A parameter's global description and every stored piece of it."""

    shape: list[int]
    dtype: str  # dtype of the stored values ("float32": fp32 masters)
    param_dtype: str  # dtype of the model's parameter when saved
    pieces: list[Piece] = field(default_factory=list)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "dtype": self.dtype,
            "param_dtype": self.param_dtype,
            "pieces": [p.to_json() for p in self.pieces],
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> ParamEntry:
        return ParamEntry(
            shape=[int(s) for s in d["shape"]],
            dtype=str(d["dtype"]),
            param_dtype=str(d["param_dtype"]),
            pieces=[Piece.from_json(p) for p in d["pieces"]],
        )


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dt


def dtype_to_name(dt: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dt).replace("torch.", "")


def global_flat_index(shape: list[int], tp: TPSplit | None, start: int, end: int) -> torch.Tensor:
    """``(end - start,)`` int64: the flat index in the global tensor of each element of a
    piece, or -1 where the element is tensor-parallel padding."""
    pos = torch.arange(start, end, dtype=torch.int64)
    if tp is None:
        return pos
    local = tp.local_shape(tuple(shape))
    coords = []
    rest = pos
    for size in reversed(local):  # unravel the local flat positions
        coords.append(rest % size)
        rest = rest // size
    coords.reverse()
    along = coords[tp.dim] + (tp.index // tp.replicas) * tp.block
    pad = along >= tp.full
    coords[tp.dim] = along.clamp(max=max(0, tp.full - 1))
    flat = torch.zeros_like(pos)
    for c, size in zip(coords, shape, strict=True):  # ravel in the global shape
        flat = flat * size + c
    flat[pad] = -1
    return flat


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode("utf-8")


def read_metadata(folder: Path) -> dict[str, Any]:
    """``metadata.json`` of a checkpoint folder, checked for format and version."""
    path = folder / METADATA
    if not path.is_file():
        raise CorruptCheckpointError(f"checkpoint {folder}: {METADATA} is missing")
    try:
        meta = json.loads(path.read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        msg = f"checkpoint {folder}: {METADATA} is unreadable ({e})"
        raise CorruptCheckpointError(msg) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{folder} is not a plait checkpoint ({METADATA} has no format)")
    if meta.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {folder} has format version {meta.get('version')}; this plait "
            f"reads version {VERSION}"
        )
    return meta


def params_of(meta: dict[str, Any]) -> dict[str, ParamEntry]:
    """The parameter table of a checkpoint's metadata."""
    return {name: ParamEntry.from_json(d) for name, d in meta["params"].items()}


def list_steps(root: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every finished-looking checkpoint folder, oldest first."""
    out: list[tuple[int, Path]] = []
    if not root.is_dir():
        return out
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX) :].isdigit():
            out.append((int(p.name[len(STEP_PREFIX) :]), p))
    return sorted(out)


def read_latest(root: Path) -> Path | None:
    """The folder ``root/latest`` points to (None if there is no pointer)."""
    ptr = root / LATEST
    if not ptr.is_file():
        return None
    name = ptr.read_text("utf-8").strip()
    return root / name if name else None
