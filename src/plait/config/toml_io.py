"""The TOML file of a run's configuration: :func:`dump_toml` writes one table per
section, :func:`load_config` reads a file, applies command-line overrides
(:mod:`plait.config.overrides`) and builds the :class:`~plait.config.Config`
(:func:`~plait.config.coerce.config_from_dict`).

Later sources win: the defaults in :mod:`plait.config`, the TOML file, then the
overrides (``--train.steps 50`` or the short alias ``--steps 50``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from plait.config.coerce import config_from_dict, config_to_dict
from plait.config.overrides import apply_override
from plait.config.root import Config
from plait.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

_ESCAPES = {'"': '"', "\\": "\\", "\n": "n", "\t": "t", "\r": "r", "\b": "b", "\f": "f"}


def toml_value(value: Any) -> str:
    """One value (bool, int, float, str, or a list/tuple of them) as TOML text (strings
    escaped)."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr round-trips floats; inf/nan are valid TOML
    if isinstance(value, str):
        chars = []
        for ch in value:
            if ch in _ESCAPES:
                chars.append("\\" + _ESCAPES[ch])
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                chars.append(f"\\u{ord(ch):04x}")
            else:
                chars.append(ch)
        return '"' + "".join(chars) + '"'
    raise ConfigError(f"cannot write {value!r} ({type(value).__name__}) as a TOML value.")


def dump_toml(cfg: Config) -> str:
    """``cfg`` as TOML text, one table per section, readable back with :func:`load_config`."""
    lines = ["# plait configuration"]
    for section, values in config_to_dict(cfg).items():
        lines.append("")
        lines.append(f"[{section}]")
        lines.extend(f"{name} = {toml_value(value)}" for name, value in values.items())
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- reading


def read_toml(path: str) -> dict[str, Any]:
    """The parsed TOML file at ``path``; an unreadable or invalid file is one
    :class:`ConfigError` naming it."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' does not exist.") from None
    except IsADirectoryError:
        raise ConfigError(f"cannot read config file '{path}': it is a directory.") from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"cannot read config file '{path}': {reason}.") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file '{path}' is not valid UTF-8 (byte {exc.start}).") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML in config file '{path}': {exc}") from None


def load_config(path: str | None, overrides: Sequence[str] = ()) -> Config:
    """Read the TOML file at ``path`` (if any), apply ``overrides``, and build the config.

    ``overrides`` are ``"section.field=value"`` strings; each value is parsed by the
    field's type (``none``/``null`` clears an optional field). Overrides win over the file.
    """
    return config_from_dict(load_config_data(path, overrides))


def load_config_data(path: str | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The raw ``{section: {field: value}}`` of the TOML file at ``path`` with
    ``overrides`` applied and their values parsed, not yet built into a :class:`Config`
    (a command fills run-dependent defaults in, then calls :func:`config_from_dict`)."""
    data: dict[str, Any] = read_toml(path) if path is not None else {}
    for override in overrides:
        apply_override(data, override)
    return data
