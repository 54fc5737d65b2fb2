"""Errors plait raises on purpose, each meant to be read by a person."""

from __future__ import annotations

from collections.abc import Sequence


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


class OutOfMemoryError(PlaitError, RuntimeError):
    """A rank ran out of host or device memory (killed by the kernel's out-of-memory
    killer, or an allocation failed); the message names the rank, its peak memory and
    what to try. Exit code 3 (:data:`plait.cli.common.EXIT_OUT_OF_MEMORY`)."""


class UnusedParametersError(PlaitError, RuntimeError):
    """Parameters that received no gradient where every rank must reduce every gradient
    (data parallelism, ZeRO, ZeRO under pipeline parallelism); exit code 1, as every
    :class:`PlaitError` that is not bad input. ``names`` are the parameters, in order."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        shown = ", ".join(self.names[:10]) + (" ..." if len(self.names) > 10 else "")
        super().__init__(
            f"{len(self.names)} parameter(s) received no gradient in this backward pass: "
            f"{shown}. Every data-parallel rank must reduce the same gradients: make every "
            "parameter take part in the loss (set requires_grad=False on parameters that "
            "are never used), or pass find_unused_parameters=True to reduce zeros for them."
        )


def install_hint(extra: str, package: str) -> str:
    """How to install the optional ``package`` (the extra ``plait[extra]``), worded for
    how plait was installed: ``pip install -e '.[extra]'`` from a source checkout (run
    in the checkout, whose folder is named), ``pip install 'plait[extra]'`` otherwise."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]  # src/plait/errors.py -> the checkout
    project = root / "pyproject.toml"
    try:
        is_checkout = 'name = "plait"' in project.read_text("utf-8")
    except OSError:
        is_checkout = False
    if is_checkout:
        return (
            f"`python -m pip install -e '.[{extra}]'` in {root} "
            f"(or `python -m pip install {package}`)"
        )
    return f"`python -m pip install 'plait[{extra}]'` (or `python -m pip install {package}`)"
