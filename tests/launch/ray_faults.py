"""A test fixture: Ray's ``worker_process_setup_hook`` that lets a test kill a rank.

``tests/launch/test_ray_backend.py`` starts its Ray instance with this hook and the
environment variable ``PLAIT_TEST_KILL`` naming a control file. In every Ray worker
process the hook wraps :meth:`plait.train.trainer.Trainer.train_step` (in that process
only): when the control file exists and names this rank and the 1-based step it is
entering, the rank deletes the file (so the restarted job is not killed again) and
SIGKILLs itself — a crash the library cannot see coming, with no fault-injection code in
the library.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any


def install() -> None:
    """Wrap ``Trainer.train_step`` with the kill check (no control file named: nothing)."""
    control = os.environ.get("PLAIT_TEST_KILL")
    if not control:
        return
    from plait.train.trainer import Trainer

    step_once = Trainer.train_step

    @functools.wraps(step_once)
    def train_step(self: Trainer, step: int) -> Any:
        path = Path(control)
        if path.exists():
            spec = json.loads(path.read_text())
            if self.mesh.rank == spec["rank"] and step + 1 == spec["step"]:
                path.unlink()
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        return step_once(self, step)

    Trainer.train_step = train_step  # type: ignore[method-assign]
