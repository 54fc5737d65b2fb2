"""docs/context-parallel.md: its Python block runs and its commands exit 0."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from plait.cli import main

DOC = Path(__file__).resolve().parents[3] / "docs" / "context-parallel.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_python_block_runs() -> None:
    (code,) = _blocks("python")
    exec(compile(code, str(DOC), "exec"), {})


def test_commands_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    commands = [line for block in _blocks("console") for line in block.splitlines() if line]
    assert len(commands) == 2
    for line in commands:
        argv = shlex.split(line)
        assert argv[0] == "plait"
        assert main(argv[1:]) == 0, line
