"""The interface data parallelism calls per bucket instead of a plain all-reduce.

:class:`~plait.parallel.data_parallel.DataParallel` packs gradients into flat buckets, each
already divided by the group size (so a *sum* over ranks is the mean gradient). With a
compressor it hands each bucket to :meth:`Compressor.reduce` instead of launching
``all_reduce(bucket, "sum")``; the call returns a *finish* callable, and once that has
run the bucket holds the (approximate) sum over ranks, identical on every rank.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019, "EF-SGD"): a lossy method
keeps, per rank and bucket, what it did not send, ``e = (g + e_prev) - sent``, and adds
it to the next step's gradient, so nothing is lost, only delayed. Over T steps
``sum_t sent_t + e_T = sum_t g_t`` holds exactly on every rank.

Every collective is issued from the thread that runs backward, in bucket order, and a
method that needs several rounds (PowerSGD) runs them one after another before it
returns; no completion callback ever issues another collective. This is what keeps
gloo from the deadlock PyTorch's own PowerSGD hook can hit when its futures' callbacks
launch the next all-reduce.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from plait.comm import AxisGroup

Finish = Callable[[], None]
"""Completes a bucket's reduction (waits for what is in flight, writes the result)."""


def _done() -> None:
    """The finish of a reduction that completed inside :meth:`Compressor.reduce`."""


class Compressor(ABC):
    """One gradient-compression method with its per-rank state.

    Args:
        start: uncompressed (plain all-reduce) steps before compression begins
            (``parallel.compression_start``, PowerSGD's ``start_iter``).
    """

    name = "none"
    """The method's name in ``parallel.compression``."""
    error_feedback = False
    """Whether the method keeps the unsent remainder (see the module docstring)."""

    def __init__(self, start: int = 0) -> None:
        if start < 0:
            raise ValueError(f"compression start must be >= 0, got {start}")
        self.start = start
        self.steps = 0
        """Synchronising backward passes seen (optimizer steps, for the warm-up)."""
        self.errors: dict[int, torch.Tensor] = {}
        """Per bucket: ``(numel,)`` this rank's unsent remainder (pre-divided units)."""
        self.keep_sent = False
        """Record :attr:`sent` (tests check the error-feedback identity with it)."""
        self.sent: dict[int, torch.Tensor] = {}
        """Per bucket: ``(numel,)`` this rank's own contribution to the last reduction."""

    @property
    def active(self) -> bool:
        """Whether this step compresses (the warm-up steps are plain all-reduces)."""
        return self.steps >= self.start

    def end_step(self) -> None:
        """Called once after every synchronising backward pass."""
        self.steps += 1

    def set_lr(self, lr: float) -> None:
        """The learning rate of the step whose gradients are reduced next (call it before
        that step's backward; the trainer does). Methods whose residual holds *updates*
        rather than gradients rescale it so that it stays in parameter units; the others
        ignore it."""
        del lr  # gradient residuals do not depend on the learning rate

    @abstractmethod
    def reduce(
        self, key: int, flat: torch.Tensor, shapes: Sequence[torch.Size], group: AxisGroup
    ) -> Finish:
        """Start reducing bucket ``key``: ``flat`` ``(numel,)`` is this rank's gradient
        (pre-divided by the group size), the concatenation of tensors of ``shapes``. Once
        the returned callable has run, ``flat`` holds the sum over ``group``."""

    def error_of(self, key: int, flat: torch.Tensor) -> torch.Tensor:
        """Bucket ``key``'s error-feedback buffer (zeros the first time)."""
        err = self.errors.get(key)
        if err is None or err.shape != flat.shape:
            err = self.errors[key] = torch.zeros_like(flat)
        return err

    def _record_sent(self, key: int, sent: torch.Tensor) -> None:
        if self.keep_sent:
            self.sent[key] = sent.detach().clone()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state as flat tensors (saved in its checkpoint shard)."""
        out = {"steps": torch.tensor(self.steps, dtype=torch.int64)}
        for k, e in self.errors.items():
            out[f"error/{k}"] = e
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`'s values (tensors are copied)."""
        self.steps = int(state["steps"])
        self.errors = {
            int(k.split("/", 1)[1]): v.clone() for k, v in state.items() if k.startswith("error/")
        }

    def describe(self) -> str:
        """One line for the run's banner."""
        warm = f", after {self.start} plain steps" if self.start else ""
        return f"{self.name} gradient compression{warm}"
