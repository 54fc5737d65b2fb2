"""A test fixture: ``plait train`` whose ranks SIGKILL themselves at a chosen step of the
first world of an elastic run (``--nproc MIN:MAX``).

Run as ``python tests/launch/elastic_entry.py KILL_RANKS KILL_STEP train <flags>``
(KILL_RANKS: comma-separated ranks, -1 for none). With ``PLAIT_TEST_GROW_AT=K`` in the
environment the launcher sends itself SIGUSR1 ("the ranks are back") once rank 0's
metrics file (``--metrics``) has the row of step K. In every process it (1) points the launcher's
:data:`plait.launch.local.RANK_PROGRAM` at this script with the same two arguments, so
the ranks run it too, and (2) wraps :meth:`plait.train.trainer.Trainer.train_step` so
that the chosen ranks of the first world (``PLAIT_ELASTIC_ROUND`` 0) die on entry to the
1-based step KILL_STEP: a loss the library cannot see coming, with no fault-injection
code in the library.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> int:
    """Install both hooks and run ``plait <argv[2:]>``."""
    kill, at, rest = {int(r) for r in argv[0].split(",")}, int(argv[1]), argv[2:]

    import plait.launch.local as local
    from plait.cli import main as plait_main
    from plait.launch.elastic import ROUND_ENV
    from plait.train.trainer import Trainer

    local.RANK_PROGRAM = (os.path.abspath(__file__), argv[0], argv[1])
    step_once = Trainer.train_step

    @functools.wraps(step_once)
    def train_step(self: Trainer, step: int) -> Any:
        first = os.environ.get(ROUND_ENV) == "0"
        if first and self.mesh.rank in kill and step + 1 == at:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return step_once(self, step)

    Trainer.train_step = train_step  # type: ignore[method-assign]
    grow_at = os.environ.get("PLAIT_TEST_GROW_AT")
    if grow_at and "RANK" not in os.environ:  # the launcher, not a rank
        metrics = Path(rest[rest.index("--metrics") + 1])
        threading.Thread(target=_grow_at, args=(metrics, int(grow_at)), daemon=True).start()
    return plait_main(rest)


def _grow_at(metrics: Path, step: int) -> None:
    """SIGUSR1 to this process once ``metrics`` has the row of ``step``."""
    while True:
        rows = metrics.read_text().splitlines() if metrics.exists() else []
        if any(json.loads(r)["step"] >= step for r in rows if r.strip()):
            os.kill(os.getpid(), signal.SIGUSR1)
            return
        time.sleep(0.01)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
