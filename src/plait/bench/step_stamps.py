"""When each step of a run in another process finished: a watcher of its metrics file.

Benchmarks that time a whole ``plait train`` (start-up, recovery after a killed rank)
stamp the moment each step's row first appears in the run's metrics JSONL
(:func:`watch_rows`, on a thread, until ``done`` is set). A resumed run rewrites the file
(it keeps the rows up to the step it resumed from); rows already stamped keep their
first time.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

POLL_S = 0.005
"""How often the file is read."""


def watch_rows(path: Path, stamps: dict[int, float], done: threading.Event) -> None:
    """Record in ``stamps`` the ``time.perf_counter()`` at which each step's row first
    appears in ``path``, until ``done`` is set."""
    seen = 0
    while not done.is_set():
        if path.exists():
            lines = path.read_text().splitlines()
            if len(lines) < seen:  # rewritten after a resume
                seen = len(lines)
            for line in lines[seen:]:
                try:
                    step = int(json.loads(line)["step"])
                except (ValueError, KeyError):
                    break
                stamps.setdefault(step, time.perf_counter())
                seen += 1
        time.sleep(POLL_S)
