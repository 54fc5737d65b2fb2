"""What a rank reads of the data, and the report of it (issue 44).

Without a pipeline every rank reads its slice of each step's windows whole. With one,
only the rank holding the first virtual stage needs the inputs and only the one holding
the last needs the targets (virtual stage ``s`` lives on pipeline rank ``s mod p``: the
first on rank 0, the last on rank ``p - 1``); a middle rank reads nothing and its step
gets absent tensors of the right shape (:mod:`plait.data.parts`). Document masking would
need the tokens on every stage; it is refused with a pipeline
(:func:`plait.config.rules.features`). The bytes each rank read
(:data:`plait.data.read_count.READ`) are gathered at the end of a run for its report.
"""

from __future__ import annotations

import torch

from plait import comm
from plait.data.parts import BOTH, Parts, absent, is_absent
from plait.mesh import Mesh
from plait.parallel.model import ParallelModel


def stage_parts(model: ParallelModel) -> Parts:
    """The halves of a batch this rank's pipeline pieces need (both without a pipeline)."""
    stages = model.stages
    if stages is None:
        return BOTH
    last = (stages.virtual_stages - 1) % stages.stages
    return Parts(inputs=stages.pp_index == 0, targets=stages.pp_index == last)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (asynchronously from pinned memory); an absent part stays
    absent (made there, nothing copied)."""
    if is_absent(t):
        return absent(t.shape[0], t.shape[1], device)
    return t.to(device, non_blocking=True)


def gather_read_bytes(mesh: Mesh, nbytes: int) -> list[int] | None:
    """Collective over every rank: each rank's ``nbytes`` gathered to rank 0 (through
    :mod:`plait.comm`, one int64 a rank); the list in rank order there, None elsewhere."""
    world = mesh.world()
    mine = torch.tensor([nbytes], dtype=torch.int64, device=mesh.device)
    got = comm.gather(mine, world, dst=world.ranks.index(0))
    if got is None:
        return None
    by_rank = {world.global_rank(i): int(t.item()) for i, t in enumerate(got)}
    return [by_rank[r] for r in sorted(by_rank)]


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n else "0 B"


def data_read_line(per_rank: list[int]) -> str:
    """The report: the data bytes each rank read during the run (up to 8 ranks by name,
    else the least and the most)."""
    if len(per_rank) <= 8:
        each = ", ".join(f"rank {r} {_mib(n)}" for r, n in enumerate(per_rank))
    else:
        each = f"least {_mib(min(per_rank))}, most {_mib(max(per_rank))}"
    return f"plait: data read per rank (tokens and masks): {each}"
