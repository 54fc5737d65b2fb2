"""Reading, overriding, writing and documenting a :class:`~plait.config.Config`.

A run's configuration comes from three places, later ones winning: the defaults in
:mod:`plait.config`, an optional TOML file with one table per section, and command-line
overrides such as ``--train.steps 50`` or the short alias ``--steps 50``. Every value is
checked against the field's annotation, and a misspelt key is answered with the closest
real one.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import shutil
import sys
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any, Literal, Union

from plait.config import Config
from plait.config_checks import choice_error
from plait.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

SHORT_ALIASES: dict[str, str] = {
    "nproc": "launch.nproc",
    "dp": "parallel.dp",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "cp": "parallel.cp",
    "ep": "parallel.ep",
    "zero": "parallel.zero",
    "steps": "train.steps",
    "global-batch": "train.global_batch",
    "micro-batch": "train.micro_batch",
    "seq-len": "train.seq_len",
    "lr": "train.lr",
    "seed": "train.seed",
    "data": "data.source",
    "metrics": "log.metrics",
    "device": "launch.device",
    "progress": "log.progress",
    "init-from": "train.init_from",
    # the names `plait plan` uses for the same things
    "microbatches": "parallel.microbatches",
    "chunks": "parallel.chunks",
    "schedule": "parallel.pipeline_schedule",
    "zero-shard-size": "parallel.zero_shard_size",
    "recompute": "train.recompute",
}
"""Short command-line flags (without the leading ``--``) and the dotted keys they set."""

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_NONE = frozenset({"none", "null"})


# --------------------------------------------------------------------------- schema


@cache
def _sections() -> dict[str, type]:
    """Section name -> section dataclass, in declaration order."""
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


@cache
def _fields(section: str) -> dict[str, Any]:
    """Field name -> resolved annotation for one section, in declaration order."""
    cls = _sections()[section]
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _all_keys() -> list[str]:
    return [f"{s}.{name}" for s in _sections() for name in _fields(s)]


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (tp, False)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = typing.get_args(tp)
        rest = tuple(a for a in args if a is not type(None))
        if len(rest) != len(args):
            inner = rest[0] if len(rest) == 1 else Union[rest]  # noqa: UP007
            return inner, True
    return tp, False


def _type_name(tp: Any) -> str:
    """A short human-readable name of an annotation: int, float | None, auto|cpu|cuda."""
    inner, optional = _split_optional(tp)
    if typing.get_origin(inner) is Literal:
        name = "|".join(str(a) for a in typing.get_args(inner))
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} | None" if optional else name


def _suggest(wrong: str, choices: Sequence[str]) -> str:
    match = difflib.get_close_matches(wrong, choices, n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else ""


def _unknown_section(name: str) -> ConfigError:
    sections = list(_sections())
    hint = _suggest(name, sections)
    if not hint:
        owners = [s for s in sections if name in _fields(s)]
        if owners:
            hint = f"; did you mean '{owners[0]}.{name}'?"
    if not hint:
        hint = f"; the sections are {', '.join(sections)}."
    return ConfigError(f"unknown config section '{name}'{hint}")


def _unknown_field(section: str, name: str) -> ConfigError:
    key = f"{section}.{name}"
    if section in _sections():
        match = difflib.get_close_matches(name, list(_fields(section)), n=1, cutoff=0.6)
        if match:
            return ConfigError(f"unknown config key '{key}'; did you mean '{section}.{match[0]}'?")
    owners = [s for s in _sections() if name in _fields(s)]
    hint = f"; did you mean '{owners[0]}.{name}'?" if owners else _suggest(key, _all_keys())
    if not hint and section not in _sections():
        hint = f"; the sections are {', '.join(_sections())}."
    return ConfigError(f"unknown config key '{key}'{hint}")


def _check_key(key: str) -> tuple[str, str]:
    """Split a dotted key into (section, field), raising a close-match error if unknown."""
    parts = key.split(".")
    if len(parts) != 2 or not all(parts):
        hint = _suggest(key, _all_keys())
        raise ConfigError(f"config key '{key}' must have the form section.field{hint}")
    section, name = parts
    if section not in _sections() or name not in _fields(section):
        raise _unknown_field(section, name)
    return section, name


# --------------------------------------------------------------------------- building


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against annotation ``tp`` (ints widen to float; a value of a
    ``Literal`` field is checked by its section, in one wording)."""
    inner, optional = _split_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got None.")
    if typing.get_origin(inner) is Literal:
        return value  # the section's own check refuses any other (config.check_choices)
    accepted = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}.get(inner, ())
    ok = isinstance(value, accepted) and (inner is bool or not isinstance(value, bool))
    if ok:
        return float(value) if inner is float else value
    raise ConfigError(
        f"config key '{key}' expects {_type_name(tp)}, got {value!r} ({type(value).__name__})."
    )


def _table(section: str, value: Any) -> Mapping[str, Any]:
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
    table = _table("<root>", data)
    for name in table:
        if name not in _sections():
            raise _unknown_section(str(name))
    built: dict[str, Any] = {}
    for section, cls in _sections().items():
        values = _table(section, table.get(section, {}))
        kwargs: dict[str, Any] = {}
        for name, value in values.items():
            if name not in _fields(section):
                raise _unknown_field(section, str(name))
            kwargs[name] = _coerce(f"{section}.{name}", _fields(section)[name], value)
        built[section] = cls(**kwargs)
    return Config(**built)


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Nested plain dict of ``cfg``; fields that are ``None`` are left out (TOML has no null)."""
    out: dict[str, dict[str, Any]] = {}
    for section in _sections():
        obj = getattr(cfg, section)
        out[section] = {
            name: getattr(obj, name) for name in _fields(section) if getattr(obj, name) is not None
        }
    return out


_ESCAPES = {'"': '"', "\\": "\\", "\n": "n", "\t": "t", "\r": "r", "\b": "b", "\f": "f"}


def _toml_value(value: Any) -> str:
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
        lines.extend(f"{name} = {_toml_value(value)}" for name, value in values.items())
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- loading


def _parse_value(key: str, tp: Any, text: str) -> Any:
    """Parse the command-line text ``text`` for a field annotated ``tp``."""
    inner, optional = _split_optional(tp)
    lowered = text.strip().lower()
    if optional and lowered in _NONE:
        return None
    if typing.get_origin(inner) is Literal:
        for choice in typing.get_args(inner):
            if str(choice) == text.strip():
                return choice
        raise choice_error(key, text, typing.get_args(inner))
    try:
        if inner is bool:
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError(text)
        if inner is int:
            return int(text)
        if inner is float:
            return float(text)
    except ValueError:
        expected = _type_name(inner) + (" (true/false, yes/no, 1/0)" if inner is bool else "")
        expected += " or none" if optional else ""
        raise ConfigError(f"config key '{key}' expects {expected}, got {text!r}.") from None
    return text


def _apply_override(data: dict[str, Any], override: str) -> None:
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(f"override {override!r} must have the form section.field=value.")
    section, name = _check_key(key)
    current = data.get(section, {})
    table = dict(_table(section, current))
    table[name] = _parse_value(key, _fields(section)[name], text)
    data[section] = table


def _read_toml(path: str) -> dict[str, Any]:
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
    data: dict[str, Any] = _read_toml(path) if path is not None else {}
    for override in overrides:
        _apply_override(data, override)
    return data


def unknown_flag_error(flag: str, options: Sequence[str] = ()) -> ConfigError:
    """A :class:`ConfigError` for the command-line flag ``flag`` (``--stpes``) that
    suggests the closest short alias, dotted key or other ``options`` (``--config``)."""
    name = flag.removeprefix("--").partition("=")[0]
    choices = [*SHORT_ALIASES, *_all_keys(), *(o.removeprefix("--") for o in options)]
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    if not match and "." not in name:  # a field name without its section: --warmup_steps
        owners = [f"{s}.{name}" for s in _sections() if name in _fields(s)]
        match = owners[:1]
    hint = f"; did you mean '--{match[0]}'?" if match else "; see --help and --help-config."
    return ConfigError(f"unknown option '--{name}'{hint}")


def parse_override_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Pull config flags out of a command line.

    ``--section.field VALUE``, ``--section.field=VALUE`` and the :data:`SHORT_ALIASES`
    (``--steps 50``) become ``"section.field=VALUE"`` overrides. Everything else is
    returned unchanged, in order, as the remaining arguments; nothing after ``--`` is
    touched. Returns ``(overrides, remaining)``.
    """
    overrides: list[str] = []
    remaining: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            remaining.extend(argv[i - 1 :])
            break
        if not arg.startswith("--"):
            remaining.append(arg)
            continue
        flag, sep, value = arg[2:].partition("=")
        if flag in SHORT_ALIASES:
            key = SHORT_ALIASES[flag]
        elif "." in flag:
            key = flag
        else:
            remaining.append(arg)
            continue
        if not sep:
            if i >= len(argv) or argv[i].startswith("--"):
                raise ConfigError(f"flag --{flag} needs a value (it sets {key}).")
            value = argv[i]
            i += 1
        overrides.append(f"{key}={value}")
    return overrides, remaining


# --------------------------------------------------------------------------- docs


@cache
def _source_docs() -> dict[str, str]:
    """Docstrings under the annotated fields of the config classes, keyed Class.field.

    Read from the source of every module of the :mod:`plait.config` package that defines
    a section or the root :class:`Config`, in section order.
    """
    classes = (*_sections().values(), Config)
    modules = dict.fromkeys(inspect.getmodule(cls) for cls in classes)
    try:
        trees = [ast.parse(inspect.getsource(m)) for m in modules if m is not None]
    except (OSError, TypeError, SyntaxError):  # source not shipped: no docs, still a table
        return {}
    docs: dict[str, str] = {}
    for node in (node for tree in trees for node in tree.body):
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for stmt, after in itertools.pairwise(body):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[f"{node.name}.{stmt.target.id}"] = " ".join(after.value.value.split())
    return docs


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is dataclasses.MISSING or f.default is None:
        return "-"  # derived from other fields (the docstring says how) or required
    return _toml_value(f.default)


def field_docs() -> list[tuple[str, str, str, str]]:
    """``(dotted key, type, default, docstring)`` for every config field, in order.

    Docstrings are read with :mod:`ast` from the string literal under each field in
    the ``plait/config/`` package; a default of ``-`` means "derived" (see the docstring).
    """
    docs = _source_docs()
    return [
        (
            f"{section}.{f.name}",
            _type_name(_fields(section)[f.name]),
            _default_text(f),
            docs.get(f"{cls.__name__}.{f.name}", ""),
        )
        for section, cls in _sections().items()
        for f in dataclasses.fields(cls)
    ]


def format_field_docs(width: int | None = None) -> str:
    """The :func:`field_docs` table as text, one block per section.

    ``width`` defaults to the terminal's; when the docstring column would be narrower
    than 40 characters, each docstring goes on the lines under its key instead (and
    when even the key, type and default columns do not fit, they are not aligned).
    """
    width = width or shutil.get_terminal_size((100, 24)).columns
    rows = field_docs()
    docs = _source_docs()
    w_key, w_type, w_default = (max(len(r[i]) for r in rows) for i in range(3))
    indent = 2 + w_key + 2 + w_type + 2 + w_default + 2
    if indent > width:  # too narrow for aligned columns: each row's own widths
        w_key = w_type = w_default = 0
    inline = width - indent >= 40
    doc_indent = indent if inline else 6
    out: list[str] = []
    for section in _sections():
        title = docs.get(f"Config.{section}", "")
        out.extend(["", f"[{section}]" + (f"  {title}" if title else "")])
        for key, type_name, default, doc in rows:
            if not key.startswith(section + "."):
                continue
            head = f"  {key:<{w_key}}  {type_name:<{w_type}}  {default:<{w_default}}  "
            lines = textwrap.wrap(doc, max(20, width - doc_indent))
            if inline and lines:
                head += lines.pop(0)
            out.append(head.rstrip())
            out.extend(" " * doc_indent + line for line in lines)
    return "\n".join(out[1:]) + "\n"
