"""Errors plait raises on purpose, each meant to be read by a person."""

from __future__ import annotations


class PlaitError(Exception):
    """Base class of plait's own errors."""


class ConfigError(PlaitError, ValueError):
    """A configuration, layout or input that cannot work; raised before any work starts."""


class DataError(ConfigError):
    """A dataset that is missing, empty or unreadable."""


class CommTimeoutError(PlaitError, TimeoutError):
    """A collective or point-to-point operation did not complete within the group timeout."""

    def __init__(self, rank: int, axis: str, op: str, timeout_s: float, detail: str = "") -> None:
        self.rank = rank
        self.axis = axis
        self.op = op
        self.timeout_s = timeout_s
        msg = (
            f"rank {rank}: {op} on mesh axis '{axis}' did not complete within "
            f"{timeout_s:g} s; a peer rank is dead, hung, or never entered the {op}"
        )
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class CommError(PlaitError, RuntimeError):
    """A collective failed for a reason other than a timeout (e.g. a peer exited)."""
