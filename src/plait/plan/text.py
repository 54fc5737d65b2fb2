"""How the planner writes sizes and durations in its messages (one place for each)."""

from __future__ import annotations


def gib(nbytes: float) -> str:
    """``12.3 GiB``."""
    return f"{nbytes / 2**30:.1f} GiB"


def gib_or_mib(nbytes: float) -> str:
    """:func:`gib` from a quarter GiB up, ``12.34 MiB`` below (a small model's host bytes)."""
    return gib(nbytes) if nbytes >= 2**28 else f"{nbytes / 2**20:.2f} MiB"


def seconds(s: float) -> str:
    """A duration with a unit that suits it."""
    if s >= 1.0:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"
