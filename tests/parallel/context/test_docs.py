"""docs/context-parallel.md: its Python block runs (its commands: tests/cli)."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "context-parallel.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_python_block_runs() -> None:
    (code,) = _blocks("python")
    exec(compile(code, str(DOC), "exec"), {})


def test_commands_are_run_elsewhere() -> None:
    """The page's commands run, and match one process, in
    tests/cli/test_train_context.py (so each spawns its ranks once in the suite)."""
    from tests.cli.test_train_context import doc_commands

    assert len(doc_commands()) == len(
        [ln for b in _blocks("console") for ln in b.splitlines() if ln.strip()]
    )
