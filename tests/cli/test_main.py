"""The top-level ``plait`` command: dispatch, exit codes, and a start without torch
(importing any sub-command's module imports no torch either)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from collections.abc import Sequence

import pytest

import plait.cli
from plait.cli import EXIT_BAD_INPUT, SUBCOMMANDS, main
from plait.errors import ConfigError, PlaitError

SUB_MODULES = sorted(m.name for m in pkgutil.iter_modules(plait.cli.__path__))
"""Every module of plait.cli; importing any of them imports no torch."""


def test_every_sub_command_is_a_function_of_its_own_module() -> None:
    for name, (load, help_text) in SUBCOMMANDS.items():
        command = load()
        assert callable(command) and help_text
        assert command.__module__.startswith("plait.cli."), (name, command.__module__)


def test_unknown_command_and_no_command_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["nonsense"])
    assert e.value.code == EXIT_BAD_INPUT
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == EXIT_BAD_INPUT
    assert "invalid choice" in capsys.readouterr().err


def test_bad_input_is_one_paragraph_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--train.steps", "0"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("plait: error: train.steps must be positive") and "Traceback" not in err


def test_calibrate_is_an_alias_of_bench_calibrate() -> None:
    from plait.cli.bench import BENCHMARKS

    assert SUBCOMMANDS["calibrate"][0]() is BENCHMARKS["calibrate"][0]


def test_errors_of_a_sub_command_become_exit_codes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def failing(argv: Sequence[str]) -> int:
        raise {"bad": ConfigError, "fail": PlaitError}[argv[0]]("it went wrong")

    def interrupted(argv: Sequence[str]) -> int:
        raise KeyboardInterrupt

    monkeypatch.setitem(SUBCOMMANDS, "plan", (lambda: failing, "test"))
    monkeypatch.setitem(SUBCOMMANDS, "pipeline", (lambda: interrupted, "test"))
    assert main(["plan", "bad"]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == "plait: error: it went wrong\n"
    assert main(["plan", "fail"]) == 1
    assert capsys.readouterr().err == "plait: it went wrong\n"
    assert main(["pipeline"]) == 130
    assert capsys.readouterr().err == "plait: interrupted\n"


def test_help_starts_without_torch() -> None:
    modules = ", ".join(f"plait.cli.{m}" for m in SUB_MODULES)
    code = f"import sys\nimport {modules}\nassert 'torch' not in sys.modules\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "plait", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("plait ")
