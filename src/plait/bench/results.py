"""Recording a benchmark's table in ``benchmarks/RESULTS.md``: one section per benchmark.

Each benchmark owns the lines between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``
and rewrites only those (:func:`write_section`), so benchmarks of different issues share
the file without touching each other's sections. :func:`environment`,
:func:`load_average` and :func:`command_line` give the pieces of the note every recorded
table carries (when, on what, under which load, from which command).
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

EMPTY = "# Benchmark results\n"  # a new results file starts with this title


def markers(name: str) -> tuple[str, str]:
    """The begin and end marker lines of the section ``name``."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_section(path: Path, name: str, text: str) -> None:
    """Put ``text`` between the markers of section ``name`` in the markdown file ``path``.

    The old text between the markers is replaced and everything outside them is kept as
    it was; a file without the section gets it appended after one blank line; a missing
    file is created with the title :data:`EMPTY`. ``text`` stands verbatim between the
    two marker lines.
    """
    begin, end = markers(name)
    block = f"{begin}\n{text}\n{end}"
    old = path.read_text() if path.exists() else EMPTY
    if begin in old and end in old:
        pre, rest = old.split(begin, 1)
        _, post = rest.split(end, 1)
        new = pre + block + post
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(new)


def environment() -> str:
    """``Date: <local time>; torch <version>; Python <version>`` — the start of the
    environment line of a recorded table (callers add cores, backend, threads)."""
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return f"Date: {date}; torch {torch.__version__}; Python {platform.python_version()}"


def load_average() -> float:
    """The 1-minute load average (0 where the platform has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def command_line(script: str) -> str:
    """``python <script relative to the working directory> <this process's arguments>``,
    shell-quoted: the command that reproduces a recorded run."""
    words = [os.path.relpath(script, Path.cwd()), *sys.argv[1:]]
    return "python " + " ".join(shlex.quote(a) for a in words)


def cpu_busy(interval: float = 0.5) -> float:
    """Fraction of all cores busy over ``interval`` seconds (from /proc/stat; 0 elsewhere)."""

    def sample() -> tuple[int, int]:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                vals = [int(v) for v in f.readline().split()[1:]]
        except OSError:
            return 0, 0
        return sum(vals), vals[3] + vals[4]  # total, idle + iowait

    t0, i0 = sample()
    time.sleep(interval)
    t1, i1 = sample()
    return 0.0 if t1 == t0 else 1.0 - (i1 - i0) / (t1 - t0)


def wait_quiet(threshold: float, max_wait_s: float) -> float:
    """Wait (at most ``max_wait_s``) until other processes keep less than ``threshold``
    of the cores busy; returns the last busy fraction seen."""
    deadline = time.monotonic() + max_wait_s
    busy = cpu_busy()
    while busy > threshold and time.monotonic() < deadline:
        time.sleep(2.0)
        busy = cpu_busy()
    return busy
