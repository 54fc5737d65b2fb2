"""The stateless batch order: :class:`BatchSampler` gives the global batch of every
optimizer step as a pure function of ``(seed, step)``, so a run resumes at any step with
no saved state and the data order does not depend on the data-parallel degree. The
permutation of each epoch is an :mod:`~plait.data.order` (``"feistel"``: evaluated per
position, so a rank's memory for the order does not grow with the data); the state
records which.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from plait.data.order import DEFAULT_ORDER, LEGACY_ORDER, ORDERS, Order, make_order
from plait.errors import ConfigError, DataError


class BatchSampler:
    """Sample indices of every optimizer step, for one data-parallel rank.

    The samples are visited in a fresh seeded permutation each epoch (``order``, one of
    :data:`~plait.data.order.ORDERS`; a loaded state sets the one it was saved with); global batch
    ``step`` is positions ``[step·G, (step+1)·G)`` of the concatenated permutations
    (a batch may straddle two epochs, and then may hold a sample twice; never when
    ``num_samples`` is a multiple of the global batch). Rank ``r`` of ``D`` takes the
    contiguous slice ``[r·G/D, (r+1)·G/D)`` of it. All of it is a pure function of
    ``(seed, step)``.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        order: str = DEFAULT_ORDER,
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
        if order not in ORDERS:
            raise ConfigError(f"unknown data order {order!r}; plait knows {', '.join(ORDERS)}.")
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
        self.order = order
        """The permutation algorithm (:data:`~plait.data.order.ORDERS`)."""
        self._order: Order = make_order(order, num_samples, seed)

    def set_order(self, order: str) -> None:
        """Visit the samples in ``order`` from now on (a resumed run's own)."""
        if order not in ORDERS:
            raise DataError(
                f"cannot resume the data order: the checkpoint's order {order!r} is not one "
                f"of {', '.join(ORDERS)} (written by a newer plait?)."
            )
        if order != self.order:
            self.order, self._order = order, make_order(order, self.num_samples, self.seed)

    @property
    def per_rank(self) -> int:
        """Samples of one rank per optimizer step."""
        return self.global_batch // self.dp_size

    def epoch_of(self, step: int) -> float:
        """Fractional epoch at the start of ``step``."""
        return step * self.global_batch / self.num_samples

    def positions(self, step: int, start: int, stop: int) -> np.ndarray:
        """Window indices of places ``[start, stop)`` of step ``step``'s global batch,
        ``(stop - start,)`` int64, evaluated for those places only."""
        if step < 0:
            raise ValueError(f"step must not be negative, got {step}")
        base = step * self.global_batch
        return self._order(np.arange(base + start, base + stop, dtype=np.int64))

    def global_indices(self, step: int) -> list[int]:
        """The ``global_batch`` sample indices of optimizer step ``step``."""
        return self.positions(step, 0, self.global_batch).tolist()

    def rank_indices(self, step: int) -> list[int]:
        """This rank's contiguous slice of :meth:`global_indices`."""
        start = self.dp_rank * self.per_rank
        return self.positions(step, start, start + self.per_rank).tolist()

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
        """The step plus what the order depends on (checked on load) and its algorithm."""
        return {
            "step": self.step,
            "order": self.order,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["step"]`` in the state's order (a state without one was saved
        before orders had names: :data:`~plait.data.order.LEGACY_ORDER`); the
        data-parallel degree may differ."""
        for key in ("seed", "num_samples", "global_batch"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"cannot resume the data order: the checkpoint has {key}={state[key]} "
                    f"but this run has {key}={getattr(self, key)}."
                )
        self.set_order(str(state.get("order", LEGACY_ORDER)))
        self.step = int(state["step"])
