"""The stateless batch order: :class:`BatchSampler` gives the global batch of every
optimizer step as a pure function of ``(seed, step)``, so a run resumes at any step with
no saved state and the data order does not depend on the data-parallel degree.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from plait.errors import ConfigError, DataError


def _epoch_seed(seed: int, epoch: int) -> int:
    """Deterministic 63-bit seed of one epoch's permutation (splitmix64-style mixing)."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E37_79B9_7F4A_7C15 + (epoch + 1) * 0xBF58_476D_1CE4_E5B9) & mask
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & mask
    return (z ^ (z >> 31)) >> 1


class BatchSampler:
    """Sample indices of every optimizer step, for one data-parallel rank.

    The samples are visited in a fresh seeded permutation each epoch; global batch
    ``step`` is positions ``[step·G, (step+1)·G)`` of the concatenated permutations
    (a batch may straddle two epochs, and then may hold a sample twice; never when
    ``num_samples`` is a multiple of the global batch). Rank ``r`` of ``D`` takes the
    contiguous slice ``[r·G/D, (r+1)·G/D)`` of it. All of it is a pure function of
    ``(seed, step)``.
    """

    def __init__(
        self, num_samples: int, global_batch: int, dp_rank: int, dp_size: int, seed: int
    ) -> None:
        if global_batch <= 0 or dp_size <= 0:
            raise ConfigError("global_batch and dp_size must be positive.")
        if global_batch % dp_size:
            raise ConfigError(
                f"the global batch ({global_batch}) must be divisible by the data-parallel "
                f"degree ({dp_size})."
            )
        if not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank {dp_rank} is not in [0, {dp_size}).")
        if num_samples < global_batch:
            raise DataError(
                f"{num_samples} sample(s) cannot fill a global batch of {global_batch}."
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.step = 0
        """Next step :meth:`__iter__` yields; the only state."""
        self._perms: dict[int, np.ndarray] = {}  # cache of recent epochs' permutations

    @property
    def per_rank(self) -> int:
        """Samples of one rank per optimizer step."""
        return self.global_batch // self.dp_size

    def epoch_of(self, step: int) -> float:
        """Fractional epoch at the start of ``step``."""
        return step * self.global_batch / self.num_samples

    def permutation(self, epoch: int) -> np.ndarray:
        """Visiting order of the samples in ``epoch``, ``(num_samples,)`` (int32 when the
        indices fit: 4 bytes a window, not a Python list's ~36)."""
        perm = self._perms.get(epoch)
        if perm is None:
            gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            full = torch.randperm(self.num_samples, generator=gen, device="cpu").numpy()
            perm = full.astype(np.int32) if self.num_samples < 2**31 else full
            del full
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def global_indices(self, step: int) -> list[int]:
        """The ``global_batch`` sample indices of optimizer step ``step``."""
        if step < 0:
            raise ValueError(f"step must not be negative, got {step}")
        out: list[int] = []
        pos = step * self.global_batch
        while len(out) < self.global_batch:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(self.global_batch - len(out), self.num_samples - offset)
            out.extend(self.permutation(epoch)[offset : offset + take].tolist())
            pos += take
        return out

    def rank_indices(self, step: int) -> list[int]:
        """This rank's contiguous slice of :meth:`global_indices`."""
        start = self.dp_rank * self.per_rank
        return self.global_indices(step)[start : start + self.per_rank]

    def micro_batches(self, step: int, micro_batch: int) -> list[list[int]]:
        """:meth:`rank_indices` split in order into micro-batches of ``micro_batch``."""
        if micro_batch <= 0 or self.per_rank % micro_batch:
            raise ConfigError(
                f"the per-rank batch ({self.per_rank}) must be divisible by the micro-batch "
                f"({micro_batch})."
            )
        mine = self.rank_indices(step)
        return [mine[i : i + micro_batch] for i in range(0, len(mine), micro_batch)]

    def __iter__(self) -> Iterator[list[int]]:
        """Endless :meth:`rank_indices` from :attr:`step` on, advancing :attr:`step`."""
        while True:
            indices = self.rank_indices(self.step)
            self.step += 1
            yield indices

    def state_dict(self) -> dict[str, Any]:
        """The step plus what the order depends on (checked on load)."""
        return {
            "step": self.step,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["step"]``; the data-parallel degree may differ."""
        for key in ("seed", "num_samples", "global_batch"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"cannot resume the data order: the checkpoint has {key}={state[key]} "
                    f"but this run has {key}={getattr(self, key)}."
                )
        self.step = int(state["step"])
