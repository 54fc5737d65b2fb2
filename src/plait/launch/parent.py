"""Ranks die with their launcher.

A rank started by ``plait train --nproc`` or by ``torchrun`` asks the Linux kernel to send
it SIGKILL when its parent (the elastic agent: plait's launcher or torchrun) dies, however
the parent dies (``kill -9`` included): ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` through
ctypes. Without it the ranks of a killed launcher keep training under PID 1 and keep
writing checkpoints. SIGKILL, not SIGTERM: nobody is left to report a graceful stop, and a
save cut short leaves the previous checkpoint intact (saves are atomic). A graceful stop is
SIGTERM/SIGINT *to the launcher*, which forwards it (:mod:`plait.launch.local`).

On systems without ``prctl`` (macOS, Windows) this does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal sent to this process when its parent thread dies."""


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies; returns whether
    that is in place (False off Linux). A parent that died before the call is caught by
    checking for re-parenting afterwards."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent or parent == 1:  # the parent is already gone
        os.kill(os.getpid(), sig)
    return True
