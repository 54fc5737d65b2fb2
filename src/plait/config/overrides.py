"""Command-line overrides of a run's configuration: ``--section.field VALUE``,
``--section.field=VALUE`` and the short aliases (:data:`SHORT_ALIASES`: ``--steps 50``),
each value parsed by its field's type; a misspelt flag is answered with the closest real
one."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Sequence
from typing import Any, Literal

from plait.config.coerce import (
    all_keys,
    as_table,
    check_key,
    fields_of,
    number_words,
    section_classes,
    split_optional,
    type_name,
)
from plait.config.rules.choices import choice_error
from plait.config.rules.elastic import parse_nproc_range
from plait.errors import ConfigError

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


def _parse_value(key: str, tp: Any, text: str) -> Any:
    """Parse the command-line text ``text`` for a field annotated ``tp``."""
    inner, optional = split_optional(tp)
    lowered = text.strip().lower()
    if optional and lowered in _NONE:
        return None
    if typing.get_origin(inner) is Literal:
        for choice in typing.get_args(inner):
            if str(choice) == text.strip():
                return choice
        raise choice_error(key, text, typing.get_args(inner))
    if typing.get_origin(inner) is tuple:  # tuple[str, ...]: comma-separated
        return tuple(part.strip() for part in text.split(",") if part.strip())
    shown = type_name(inner)
    words = number_words(inner)
    if text.strip() in words:  # int | Literal["auto"]: the word, else a number
        return text.strip()
    if words:
        inner = int
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
        expected = shown + (" (true/false, yes/no, 1/0)" if inner is bool else "")
        expected += " or none" if optional else ""
        raise ConfigError(f"config key '{key}' expects {expected}, got {text!r}.") from None
    return text


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one ``"section.field=value"`` override to the raw ``data``, the value parsed
    by the field's type."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(f"override {override!r} must have the form section.field=value.")
    section, name = check_key(key)
    current = data.get(section, {})
    table = dict(as_table(section, current))
    if key == "launch.nproc" and ":" in text:  # --nproc MIN:MAX, an elastic run
        table["min_ranks"], table[name] = parse_nproc_range(text)
    else:
        table[name] = _parse_value(key, fields_of(section)[name], text)
    data[section] = table


def unknown_flag_error(flag: str, options: Sequence[str] = ()) -> ConfigError:
    """A :class:`ConfigError` for the command-line flag ``flag`` (``--stpes``) that
    suggests the closest short alias, dotted key or other ``options`` (``--config``)."""
    name = flag.removeprefix("--").partition("=")[0]
    choices = [*SHORT_ALIASES, *all_keys(), *(o.removeprefix("--") for o in options)]
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    if not match and "." not in name:  # a field name without its section: --warmup_steps
        owners = [f"{s}.{name}" for s in section_classes() if name in fields_of(s)]
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
