"""``plait train --help-config``: every configuration field with its type, default and
docstring (the string literal under the field in its section's module), as a table."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import shutil
import textwrap
from functools import cache
from typing import Any

from plait.config.coerce import fields_of, section_classes, type_name
from plait.config.root import Config
from plait.config.toml_io import toml_value


@cache
def _source_docs() -> dict[str, str]:
    """Docstrings under the annotated fields of the config classes, keyed Class.field.

    Read from the source of every module of the :mod:`plait.config` package that defines
    a section or the root :class:`Config`, in section order.
    """
    classes = (*section_classes().values(), Config)
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
    return toml_value(f.default)


def field_docs() -> list[tuple[str, str, str, str]]:
    """``(dotted key, type, default, docstring)`` for every config field, in order.

    Docstrings are read with :mod:`ast` from the string literal under each field in
    the ``plait/config/`` package; a default of ``-`` means "derived" (see the docstring).
    """
    docs = _source_docs()
    return [
        (
            f"{section}.{f.name}",
            type_name(fields_of(section)[f.name]),
            _default_text(f),
            docs.get(f"{cls.__name__}.{f.name}", ""),
        )
        for section, cls in section_classes().items()
        for f in dataclasses.fields(cls)
    ]


TYPE_WIDTH = 28
"""The type column's width: a longer choice list (``a|b|c``) continues on the next lines."""


def _type_lines(kind: str) -> list[str]:
    """``kind`` cut at its ``|`` separators into lines of at most :data:`TYPE_WIDTH`
    characters (one line when it fits, or when it has no separator)."""
    lines = [""]
    for part in kind.split("|"):
        piece = part if not lines[-1] else "|" + part
        if lines[-1] and len(lines[-1]) + len(piece) > TYPE_WIDTH:
            lines.append(piece)
        else:
            lines[-1] += piece
    return lines


def format_field_docs(width: int | None = None) -> str:
    """The :func:`field_docs` table as text, one block per section.

    ``width`` defaults to the terminal's; when the docstring column would be narrower
    than 40 characters, each docstring goes on the lines under its key instead (and
    when even the key, type and default columns do not fit, they are not aligned).
    """
    width = width or shutil.get_terminal_size((100, 24)).columns
    rows = field_docs()
    docs = _source_docs()
    w_key, w_default = (max(len(r[i]) for r in rows) for i in (0, 2))
    w_type = max(len(part) for r in rows for part in _type_lines(r[1]))
    indent = 2 + w_key + 2 + w_type + 2 + w_default + 2
    if indent > width:  # too narrow for aligned columns: each row's own widths
        w_key = w_type = w_default = 0
    inline = width - indent >= 40
    doc_indent = indent if inline else 6
    out: list[str] = []
    for section in section_classes():
        title = docs.get(f"Config.{section}", "")
        out.extend(["", f"[{section}]" + (f"  {title}" if title else "")])
        for key, kind, default, doc in rows:
            if not key.startswith(section + "."):
                continue
            kinds = _type_lines(kind)
            head = f"  {key:<{w_key}}  {kinds[0]:<{w_type}}  {default:<{w_default}}  "
            lines = textwrap.wrap(doc, max(20, width - doc_indent))
            if inline and lines:
                head += lines.pop(0)
            out.append(head.rstrip())
            out.extend(f"  {'':<{w_key}}  {more}" for more in kinds[1:])
            out.extend(" " * doc_indent + line for line in lines)
    return "\n".join(out[1:]) + "\n"
