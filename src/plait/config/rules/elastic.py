"""The rules of an elastic run: the range of world sizes, the allowed layouts, in-memory
checkpoints and the checkpoint interval's inputs.

See :mod:`plait.config.rules`.
"""

from __future__ import annotations

from plait.errors import ConfigError


def parse_nproc_range(text: str) -> tuple[int, int]:
    """``"MIN:MAX"`` (``plait train --nproc 2:4``) as ``(MIN, MAX)``; refused unless
    ``1 <= MIN <= MAX``."""
    lo, sep, hi = text.strip().partition(":")
    try:
        low, high = int(lo), int(hi)
    except ValueError:
        raise ConfigError(
            f"--nproc expects N or MIN:MAX (two whole numbers), got {text!r}."
        ) from None
    if not sep:
        raise ConfigError(f"--nproc expects N or MIN:MAX, got {text!r}.")
    check_min_ranks(low, high)
    return low, high


def check_min_ranks(min_ranks: int | None, nproc: int) -> None:
    """``launch.min_ranks`` (the MIN of ``--nproc MIN:MAX``) is between 1 and
    ``launch.nproc`` (MAX)."""
    if min_ranks is None:
        return
    if min_ranks < 1:
        raise ConfigError(
            f"launch.min_ranks (MIN of --nproc MIN:MAX) must be >= 1, got {min_ranks}."
        )
    if min_ranks > nproc:
        raise ConfigError(
            f"--nproc MIN:MAX has MIN > MAX ({min_ranks}:{nproc}): the job starts on MAX "
            f"ranks and may shrink down to MIN; write {nproc}:{min_ranks}."
        )


def check_start_ranks(start: int | None, min_ranks: int | None, nproc: int) -> None:
    """``launch.start_ranks`` is between MIN (``launch.min_ranks``) and MAX
    (``launch.nproc``) of an elastic run."""
    if start is None:
        return
    if min_ranks is None:
        raise ConfigError(
            "launch.start_ranks is for an elastic run; give the range with --nproc MIN:MAX."
        )
    if not min_ranks <= start <= nproc:
        raise ConfigError(
            f"launch.start_ranks = {start} must be between MIN and MAX of --nproc "
            f"{min_ranks}:{nproc}."
        )


def check_memory_checkpoints(every: int | str, world: int) -> None:
    """``train.memory_checkpoint_every`` copies each rank's state to another rank: it
    needs two ranks or more."""
    if every != 0 and world < 2:
        raise ConfigError(
            f"train.memory_checkpoint_every = {every} copies each rank's checkpoint into "
            "another rank's memory, but this run has one rank; start two or more (--nproc) "
            "or use disk checkpoints (train.checkpoint_every)."
        )


def check_interval(name: str, every: int | str) -> None:
    """A checkpoint interval is a number of steps >= 0 or 'auto'."""
    if isinstance(every, str):
        if every != "auto":
            raise ConfigError(f"{name} must be a number of steps or 'auto', got {every!r}.")
    elif every < 0:
        raise ConfigError(f"{name} must not be negative, got {every}.")


LAYOUT_AXES = ("dp", "tp", "pp", "cp")
"""The axes a layout name (``launch.layouts``) may give, in the order names are written."""


def parse_layout_name(name: str) -> dict[str, int]:
    """``"tp2xdp2"`` -> ``{"dp": 2, "tp": 2, "pp": 1, "cp": 1}`` (axes absent are 1)."""
    degrees = dict.fromkeys(LAYOUT_AXES, 1)
    seen: set[str] = set()
    for part in name.strip().lower().split("x"):
        axis, digits = part[:2], part[2:]
        if axis not in degrees or not digits.isdigit() or int(digits) < 1 or axis in seen:
            raise ConfigError(
                f"launch.layouts: {name!r} is not a layout name; write the degrees joined by "
                "'x', each axis (dp, tp, pp, cp) at most once, e.g. 'tp2xdp2' or 'dp3'."
            )
        seen.add(axis)
        degrees[axis] = int(digits)
    return degrees


def layout_name(degrees: dict[str, int]) -> str:
    """The name of a layout (:func:`parse_layout_name`'s inverse; degree-1 axes left
    out except dp): ``{"dp": 2, "tp": 2}`` -> ``"tp2xdp2"``."""
    parts = [f"{a}{degrees.get(a, 1)}" for a in ("tp", "pp", "cp") if degrees.get(a, 1) > 1]
    return "x".join([*parts, f"dp{degrees.get('dp', 1)}"])
