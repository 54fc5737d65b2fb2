"""A run's configuration as nested plain mappings and back: the schema (each section's
fields and their annotations, read from :class:`~plait.config.Config`), the check of one
value against its field's annotation, and the close-match answer to a misspelt key.

:func:`config_from_dict` builds a :class:`~plait.config.Config` from ``{section: {field:
value}}`` (parsed TOML, a checkpoint's recorded config); :func:`config_to_dict` is the
inverse. The TOML file (:mod:`plait.config.toml_io`), the command-line overrides
(:mod:`plait.config.overrides`) and ``--help-config`` (:mod:`plait.config.help_text`)
build on this schema.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any, Literal, Union

from plait.config.root import Config
from plait.errors import ConfigError

# --------------------------------------------------------------------------- schema


@cache
def section_classes() -> dict[str, type]:
    """Section name -> section dataclass, in declaration order."""
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


@cache
def fields_of(section: str) -> dict[str, Any]:
    """Field name -> resolved annotation for one section, in declaration order."""
    cls = section_classes()[section]
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def all_keys() -> list[str]:
    """Every dotted key ``section.field``, in order."""
    return [f"{s}.{name}" for s in section_classes() for name in fields_of(s)]


def split_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (tp, False)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = typing.get_args(tp)
        rest = tuple(a for a in args if a is not type(None))
        if len(rest) != len(args):
            inner = rest[0] if len(rest) == 1 else Union[rest]  # noqa: UP007
            return inner, True
    return tp, False


def number_words(tp: Any) -> tuple[str, ...]:
    """The words a number field also takes: ``int | Literal["auto"]`` -> ("auto",);
    any other annotation -> ()."""
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return ()
    args = typing.get_args(tp)
    if int not in args:
        return ()
    return tuple(w for a in args if typing.get_origin(a) is Literal for w in typing.get_args(a))


def type_name(tp: Any) -> str:
    """A short human-readable name of an annotation: int, float | None, auto|cpu|cuda."""
    inner, optional = split_optional(tp)
    if number_words(inner):
        name = "|".join(("int", *number_words(inner)))
    elif typing.get_origin(inner) is Literal:
        name = "|".join(str(a) for a in typing.get_args(inner))
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} | None" if optional else name


def _suggest(wrong: str, choices: Sequence[str]) -> str:
    match = difflib.get_close_matches(wrong, choices, n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else ""


def _unknown_section(name: str) -> ConfigError:
    sections = list(section_classes())
    hint = _suggest(name, sections)
    if not hint:
        owners = [s for s in sections if name in fields_of(s)]
        if owners:
            hint = f"; did you mean '{owners[0]}.{name}'?"
    if not hint:
        hint = f"; the sections are {', '.join(sections)}."
    return ConfigError(f"unknown config section '{name}'{hint}")


def _unknown_field(section: str, name: str) -> ConfigError:
    key = f"{section}.{name}"
    if section in section_classes():
        match = difflib.get_close_matches(name, list(fields_of(section)), n=1, cutoff=0.6)
        if match:
            return ConfigError(f"unknown config key '{key}'; did you mean '{section}.{match[0]}'?")
    owners = [s for s in section_classes() if name in fields_of(s)]
    hint = f"; did you mean '{owners[0]}.{name}'?" if owners else _suggest(key, all_keys())
    if not hint and section not in section_classes():
        hint = f"; the sections are {', '.join(section_classes())}."
    return ConfigError(f"unknown config key '{key}'{hint}")


def check_key(key: str) -> tuple[str, str]:
    """Split a dotted key into (section, field), raising a close-match error if unknown."""
    parts = key.split(".")
    if len(parts) != 2 or not all(parts):
        hint = _suggest(key, all_keys())
        raise ConfigError(f"config key '{key}' must have the form section.field{hint}")
    section, name = parts
    if section not in section_classes() or name not in fields_of(section):
        raise _unknown_field(section, name)
    return section, name


# --------------------------------------------------------------------------- building


def coerce_value(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against annotation ``tp`` (ints widen to float; a value of a
    ``Literal`` field is checked by its section, in one wording)."""
    inner, optional = split_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"config key '{key}' expects {type_name(tp)}, got None.")
    if typing.get_origin(inner) is Literal or value in number_words(inner):
        return value  # the section's own check refuses any other (config.check_choices)
    if number_words(inner):
        inner = int
    if typing.get_origin(inner) is tuple:  # tuple[str, ...]: a TOML array of strings
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(
            f"config key '{key}' expects a list of strings, got {value!r} ({type(value).__name__})."
        )
    accepted = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}.get(inner, ())
    ok = isinstance(value, accepted) and (inner is bool or not isinstance(value, bool))
    if ok:
        return float(value) if inner is float else value
    raise ConfigError(
        f"config key '{key}' expects {type_name(tp)}, got {value!r} ({type(value).__name__})."
    )


def as_table(section: str, value: Any) -> Mapping[str, Any]:
    """``value`` if it is a table (a mapping), else a :class:`ConfigError` naming ``section``."""
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"config section '{section}' must be a table of keys, "
            f"got {value!r} ({type(value).__name__})."
        )
    return value


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Build a :class:`Config` from nested mappings (e.g. parsed TOML).

    Missing sections and fields keep their defaults. Values are checked against the
    field annotations; unknown sections or fields raise :class:`ConfigError` with the
    closest real key. Errors from the dataclasses' own checks propagate unchanged.
    """
    table = as_table("<root>", data)
    for name in table:
        if name not in section_classes():
            raise _unknown_section(str(name))
    built: dict[str, Any] = {}
    for section, cls in section_classes().items():
        values = as_table(section, table.get(section, {}))
        kwargs: dict[str, Any] = {}
        for name, value in values.items():
            if name not in fields_of(section):
                raise _unknown_field(section, str(name))
            kwargs[name] = coerce_value(f"{section}.{name}", fields_of(section)[name], value)
        built[section] = cls(**kwargs)
    return Config(**built)


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Nested plain dict of ``cfg``; fields that are ``None`` are left out (TOML has no null)."""
    out: dict[str, dict[str, Any]] = {}
    for section in section_classes():
        obj = getattr(cfg, section)
        out[section] = {
            name: getattr(obj, name)
            for name in fields_of(section)
            if getattr(obj, name) is not None
        }
    return out
