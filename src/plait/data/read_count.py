"""Bytes this process has read from its data sources (token and mask bytes copied out of
a token array or a prepared folder's shards), for the trainer's "data read per rank"
report and the tests that count what a pipeline stage reads (issue 44).

One counter per process (:data:`READ`): every window set adds to it when it copies
tokens, including the background loader's thread (hence the lock).
"""

from __future__ import annotations

import threading


class ReadCounter:
    """A thread-safe running total of bytes read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more bytes read."""
        with self._lock:
            self._total += int(nbytes)

    @property
    def total(self) -> int:
        """Bytes read since the process started."""
        with self._lock:
            return self._total


READ = ReadCounter()
"""This process's data reads."""
