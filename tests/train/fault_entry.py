"""A test fixture: ``plait train`` with one rank killed at a chosen step (first attempt).

Launched by torchrun in ``test_faults.py`` as ``python tests/train/fault_entry.py
KILL_RANK KILL_STEP <plait train flags>``. Before handing over to the real command line
it wraps :meth:`plait.train.trainer.Trainer.train_step` in this process only, so that
rank KILL_RANK SIGKILLs itself when it reaches 1-based step KILL_STEP in the job's first
attempt (``TORCHELASTIC_RESTART_COUNT`` 0): a crash the library cannot see coming, with
no fault-injection code or config field in the library itself.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from typing import Any

USAGE = "usage: python fault_entry.py KILL_RANK KILL_STEP [plait train flags ...]"


def main(argv: list[str]) -> int:
    """Install the kill hook for ``argv[0]``/``argv[1]`` and run ``plait train argv[2:]``."""
    try:
        kill_rank, kill_step, rest = int(argv[0]), int(argv[1]), argv[2:]
    except (IndexError, ValueError):
        print(f"{USAGE}\ngot: {argv}", file=sys.stderr)
        return 2
    if kill_rank < 0 or kill_step < 1:
        print(
            f"{USAGE}\nKILL_RANK must be >= 0 and KILL_STEP >= 1, got {argv[:2]}", file=sys.stderr
        )
        return 2

    from plait.cli import main as plait_main
    from plait.train.faults import restart_count
    from plait.train.trainer import Trainer

    step_once = Trainer.train_step

    @functools.wraps(step_once)
    def train_step(self: Trainer, step: int) -> Any:
        """Die (SIGKILL: no cleanup, no checkpoint) on entry to the chosen 1-based step."""
        if restart_count() == 0 and self.mesh.rank == kill_rank and step + 1 == kill_step:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return step_once(self, step)

    Trainer.train_step = train_step  # type: ignore[method-assign]
    return plait_main(["train", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
