"""plait.bench.results: a benchmark rewrites only its own section of RESULTS.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from plait.bench.results import command_line, environment, load_average, markers, write_section


def test_write_section_appends_then_replaces_keeping_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## Other\n\nkeep me\n\n\n")
    write_section(path, "mine", "## Mine\n\nfirst")
    first = path.read_text()
    assert first == (
        "# Benchmark results\n\n## Other\n\nkeep me\n\n"
        "<!-- mine:begin -->\n## Mine\n\nfirst\n<!-- mine:end -->\n"
    )
    with path.open("a") as f:
        f.write("\n## After\n\nkeep me too\n")
    write_section(path, "mine", "## Mine\n\nsecond")
    second = path.read_text()
    assert second == first.replace("first", "second") + "\n## After\n\nkeep me too\n"
    write_section(path, "other", "x")  # a second section leaves the first alone
    assert path.read_text().startswith(second) and path.read_text().count("begin -->") == 2


def test_write_section_creates_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "new.md"
    write_section(path, "b", "body")
    begin, end = markers("b")
    assert path.read_text() == f"# Benchmark results\n\n{begin}\nbody\n{end}\n"


def test_environment_load_and_command(monkeypatch: pytest.MonkeyPatch) -> None:
    env = environment()
    assert env.startswith("Date: 20") and f"; torch {torch.__version__}; Python 3." in env
    assert load_average() >= 0.0
    monkeypatch.setattr(sys, "argv", ["x.py", "--out", "a b.md"])
    assert command_line(str(Path.cwd() / "benchmarks" / "x.py")) == (
        "python benchmarks/x.py --out 'a b.md'"
    )
