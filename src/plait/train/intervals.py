"""The trainer's checkpoint intervals from measurement, and the memory copies' report.

``train.checkpoint_every = auto`` / ``train.memory_checkpoint_every = auto``: on the
second step of the run the ranks save (disk) and copy (memory) once, timing each, and
agree on the slowest rank's costs and step time (one all-gather); each interval is then
Young's ``sqrt(2 C M)`` (:mod:`plait.plan.checkpoint_interval`) with ``M`` =
``launch.mtbf_hours``, in whole steps, printed on one line each with the expected loss
per failure. The first memory copy's bytes (sent, held in host memory) are printed once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from plait import comm
from plait.checkpoint import Checkpointing, TrainState
from plait.config import Config
from plait.mesh import Mesh
from plait.plan.checkpoint_interval import Interval

MEASURE_AT = 2
"""The run's step (counted from its start) whose save and copy are timed (the first
includes one-time warm-up)."""


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class CheckpointIntervals:
    """Decides the 'auto' intervals and reports the memory copies (see the module)."""

    def __init__(
        self, cfg: Config, checkpoints: Checkpointing, mesh: Mesh, say: Callable[[str], None] | None
    ) -> None:
        t = cfg.train
        self.disk_auto = t.checkpoint_every == "auto" and checkpoints.root is not None
        self.memory_auto = t.memory_checkpoint_every == "auto" and checkpoints.store is not None
        self.mtbf_s = cfg.launch.mtbf_hours * 3600.0
        self.checkpoints, self.mesh, self.say = checkpoints, mesh, say
        self.reported = False
        self.chosen: list[Interval] = []

    def after_step(self, ts: TrainState, done: int, start: int, step_s: float, last: int) -> None:
        """After the checkpoints' own ``after_step`` of step ``done``."""
        if (self.disk_auto or self.memory_auto) and done == min(start + MEASURE_AT, last - 1):
            self._measure(ts, done, step_s)
        copies = self.checkpoints.copies
        if copies and not self.reported:
            self.reported = True
            c = copies[0]
            if self.say is not None:
                self.say(
                    f"plait: memory copy of step {c.step}: {mib(c.sent_bytes)} sent to the "
                    f"buddy rank, {mib(c.held_bytes)} of host memory held per rank (its own "
                    f"and a buddy's copy), {c.seconds:.3f} s"
                )

    def _measure(self, ts: TrainState, done: int, step_s: float) -> None:
        ck = self.checkpoints
        disk_s = memory_s = 0.0
        if self.disk_auto:
            t0 = time.perf_counter()
            ck.save_now(ts, done)
            disk_s = time.perf_counter() - t0
        if self.memory_auto:
            memory_s = ck.copy_to_memory(ts, done).seconds
        mine = torch.tensor([disk_s, memory_s, step_s], dtype=torch.float64)
        if self.mesh.world_size > 1:  # every rank the same intervals: the slowest's costs
            out = comm.all_gather(mine.to(self.mesh.device), self.mesh.world())
            assert isinstance(out, torch.Tensor)
            mine = out.cpu().view(-1, 3).max(dim=0).values
        disk_s, memory_s, step_s = (float(x) for x in mine.tolist())
        if self.disk_auto:
            disk = Interval("disk", disk_s, self.mtbf_s, step_s)
            ck.every = disk.steps
            self.chosen.append(disk)
        if self.memory_auto:
            memory = Interval("memory", memory_s, self.mtbf_s, step_s)
            ck.memory_every = memory.steps
            self.chosen.append(memory)
        if self.say is not None:
            for interval in self.chosen:
                self.say(interval.line())
