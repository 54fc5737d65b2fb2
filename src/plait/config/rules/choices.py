"""Allowed values and positivity: the wording every rule shares.

See :mod:`plait.config.rules`.
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.errors import ConfigError


def _listed(values: Sequence[object]) -> str:
    """``a, b or c``."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def choice_error(
    name: str, value: object, allowed: Sequence[object], meaning: str = ""
) -> ConfigError:
    """The refusal of ``value`` for ``name``, which takes one of ``allowed``."""
    tail = f": {meaning}." if meaning else "."
    return ConfigError(f"{name} must be {_listed(allowed)}, got {value!r}{tail}")


def check_choice(name: str, value: object, allowed: Sequence[object], meaning: str = "") -> None:
    """The rule of a field with a fixed set of values (declared once, in
    :mod:`plait.config`): ``value`` must be one of ``allowed``, with its own type (True
    is not 1). ``meaning`` says what the values mean, for the message."""
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise choice_error(name, value, allowed, meaning)


def check_positive(prefix: str, **values: float | int | None) -> None:
    """Each of ``values`` (None: unset) must be positive; ``prefix`` names their owner
    (``"train."``, ``"layout "``)."""
    for name, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{prefix}{name} must be positive, got {value}.")


def check_non_negative(prefix: str, **values: float | int) -> None:
    """Each of ``values`` must be 0 or more; ``prefix`` names their owner."""
    for name, value in values.items():
        if value < 0:
            raise ConfigError(f"{prefix}{name} must be >= 0, got {value}.")
