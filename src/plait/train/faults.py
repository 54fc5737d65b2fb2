"""Fault handling around the training loop: stop requests, stragglers, restarts.

* **Lost ranks** are detected by the communication layer: every collective has the
  group timeout (``parallel.timeout_s``), and a dead or hung peer makes the survivors
  raise :class:`~plait.errors.CommError` (the peer's sockets closed: at once) or
  :class:`~plait.errors.CommTimeoutError` (the peer is silent: after the timeout), each
  naming rank, mesh axis and operation, instead of hanging. Under ``torchrun
  --max-restarts K`` the elastic agent then restarts every rank, and a restarted job
  (``TORCHELASTIC_RESTART_COUNT`` > 0, set by the agent) resumes from the latest
  checkpoint by itself (:class:`~plait.checkpoint.Checkpointing`).
* **Stop requests**: SIGTERM or SIGINT sets a flag (:class:`StopSignals`); at the next
  step boundary the ranks agree on it (a rank that got the signal tells the others),
  save a final checkpoint and leave the loop cleanly.
* **Stragglers**: after every step each rank's compute time (step time minus the time
  it was blocked in communication, i.e. waiting for others) is all-gathered over the
  world (:class:`FaultMonitor`, counted by plait.comm, 16 bytes per rank, together with
  the stop flag). A rank whose compute time exceeds the lower median by
  ``train.straggler_factor`` is reported as ``straggler(rank, factor)`` in the log and
  the step's metrics. A straggler is slow but alive; a lost rank is an error.

Fault injection is not a feature of the library: the tests kill ranks from a fixture
(``tests/train/fault_entry.py``).
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch

from plait import comm
from plait.config import Config
from plait.mesh import Mesh


def restart_count() -> int:
    """How many times torchrun's elastic agent has restarted this job (0: first attempt)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


@dataclass(frozen=True)
class Straggler:
    """A rank whose compute time in a step was ``factor`` times the median's."""

    rank: int
    factor: float
    compute_s: float
    median_s: float

    def __str__(self) -> str:
        return f"straggler(rank={self.rank}, factor={self.factor:.2f})"


@dataclass
class StepHealth:
    """What the ranks agreed on after a step."""

    stop: bool = False
    stragglers: list[Straggler] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)  # per rank

    def as_metrics(self) -> list[dict[str, float]] | None:
        """The stragglers as JSON-able rows (None when there are none)."""
        if not self.stragglers:
            return None
        return [{"rank": s.rank, "factor": round(s.factor, 3)} for s in self.stragglers]


def find_stragglers(
    compute_s: Sequence[float], factor: float, groups: Sequence[Sequence[int]] | None = None
) -> list[Straggler]:
    """Ranks slower than ``factor`` × the lower median of ``compute_s`` (the lower median
    so that with two ranks the slow one is compared with the fast one).

    ``groups`` (default: all ranks together) lists the sets of ranks that do the same work
    and are compared only with each other — pipeline stages differ in cost by design
    (the last one carries the head and the loss), so each stage is its own group.
    """
    if factor <= 0:
        return []
    found: list[Straggler] = []
    for group in groups if groups is not None else [range(len(compute_s))]:
        times = [compute_s[r] for r in group]
        if len(times) < 2:
            continue
        med = max(statistics.median_low(times), 1e-9)
        found += [
            Straggler(r, compute_s[r] / med, compute_s[r], med)
            for r in group
            if compute_s[r] > factor * med
        ]
    return sorted(found, key=lambda s: s.rank)


class StopSignals:
    """While active, SIGTERM and SIGINT set :attr:`requested` instead of killing the
    process. A second SIGINT more than :attr:`repeat_s` seconds after the first raises
    KeyboardInterrupt (one Ctrl-C in a terminal reaches a rank twice: from the terminal
    and forwarded by the launcher). Only the main thread can install handlers; elsewhere
    this does nothing."""

    repeat_s = 2.0
    """A SIGINT this soon after the first counts as the same request."""

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals = tuple(signals)
        self.requested: int | None = None
        self._at = 0.0
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.requested is not None:
            if signum == signal.SIGINT and now - self._at > self.repeat_s:
                raise KeyboardInterrupt
            return
        self.requested, self._at = signum, now

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}


class FaultMonitor:
    """Per-step agreement on stop requests and straggler detection (one all-gather)."""

    def __init__(self, cfg: Config, mesh: Mesh) -> None:
        self.mesh = mesh
        self.factor = cfg.train.straggler_factor
        self.group = mesh.world() if mesh.world_size > 1 else None
        stages: dict[int, list[int]] = {}
        for r in range(mesh.world_size):  # ranks of one pipeline stage do the same work
            stages.setdefault(mesh.layout.coords(r)["pp"], []).append(r)
        self.peers = list(stages.values())
        self.reported: dict[int, int] = {}  # rank -> steps it was a straggler
        self.signals = StopSignals()

    def steps(self, start: int, stop: int) -> Iterator[int]:
        """Steps ``start .. stop-1`` (0-based) with the stop-signal handlers installed
        (restored when the loop ends or is left)."""
        with self.signals:
            yield from range(start, stop)

    def after_step(self, step_s: float, comm_s: float) -> StepHealth:
        """Share this rank's compute time and stop flag; every rank gets the same answer."""
        busy = max(0.0, step_s - comm_s)
        stop = self.signals.requested is not None
        mine = torch.tensor([busy, 1.0 if stop else 0.0], dtype=torch.float64)
        if self.group is None:
            rows = mine.view(1, 2)
        else:
            out = comm.all_gather(mine.to(self.mesh.device), self.group)  # (2 * world,)
            assert isinstance(out, torch.Tensor)
            rows = out.cpu().view(-1, 2)  # (world, 2): compute seconds, stop flag
        compute = [float(x) for x in rows[:, 0].tolist()]
        stragglers = find_stragglers(compute, self.factor, self.peers)
        health = StepHealth(bool(rows[:, 1].max() > 0), stragglers, compute)
        for s in health.stragglers:
            self.reported[s.rank] = self.reported.get(s.rank, 0) + 1
        return health

    @staticmethod
    def describe(step: int, health: StepHealth) -> str:
        """A log line about the step's stragglers."""
        parts = [
            f"{s} ({1000 * s.compute_s:.0f} ms of compute vs median {1000 * s.median_s:.0f} ms)"
            for s in health.stragglers
        ]
        return f"plait: step {step}: " + "; ".join(parts)
