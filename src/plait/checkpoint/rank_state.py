"""Per-rank state that is not a parameter piece: saved in each rank's own shard file.

**RNG states.** Every rank saves its torch (and CUDA), Python and NumPy generator states
(:func:`rng_payload`: tensors in its file, scalars in its index); a resume restores them
(:func:`restore_rng`), and rank r of another world size takes saved rank r mod the old
world size.

**Rank-local tensors.** Some state belongs to one rank and has no one-device meaning,
such as a gradient compressor's error-feedback buffers and PowerSGD's warm-start
matrices (:class:`plait.parallel.compression.Compressor`). It is saved under
``rank_state/<name>`` in the rank's shard and restored only onto the same rank of the
same layout; under another layout it starts afresh, with a warning (the run is still
correct, only the first compressed steps differ from an uninterrupted run).
"""

from __future__ import annotations

import random
import warnings
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from plait.checkpoint.read import CheckpointReader


PREFIX = "rank_state/"


class HoldsRankState(Protocol):
    """An object with per-rank tensors to save (a gradient compressor)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The state, as named tensors."""
        ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`'s values."""
        ...


def rank_state_tensors(holder: HoldsRankState | None) -> dict[str, torch.Tensor]:
    """The shard-file entries of ``holder``'s state (none when there is no holder)."""
    if holder is None:
        return {}
    return {PREFIX + k: v.detach().to("cpu", copy=True) for k, v in holder.state_dict().items()}


def restore_rank_state(
    holder: HoldsRankState | None,
    meta: dict[str, Any],
    rank: int,
    read: Any,
) -> bool:
    """Load this rank's saved state into ``holder`` when the checkpoint has it for the
    same rank of the same world size; ``read(file, key)`` returns a stored tensor.
    Returns whether it was restored."""
    if holder is None:
        return False
    ranks = meta["ranks"]
    saved = ranks[rank] if rank < len(ranks) else None
    keys = [k for k in (saved or {}).get("keys", []) if k.startswith(PREFIX)]
    if len(ranks) != meta["layout"]["world_size"] or not keys or saved is None:
        warnings.warn(
            "the checkpoint holds no gradient-compression state for this rank and layout; "
            "error feedback starts from zero",
            stacklevel=2,
        )
        return False
    holder.load_state_dict({k[len(PREFIX) :]: read(saved["file"], k) for k in keys})
    return True


def rng_payload(device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This process's RNG states: tensors for the shard file, scalars for the index."""
    tensors = {"rng/torch": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["rng/cuda"] = torch.cuda.get_rng_state(device)
    version, py_state, gauss = random.getstate()
    tensors["rng/python"] = torch.tensor(py_state, dtype=torch.int64)
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors["rng/numpy"] = torch.from_numpy(np.asarray(np_keys, dtype=np.int64))
    info = {
        "python": [version, gauss],
        "numpy": [np_name, int(np_pos), int(np_has_gauss), float(np_gauss)],
    }
    return tensors, info


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
