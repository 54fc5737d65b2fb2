"""The top-level ``plait`` command: dispatch, exit codes, and a start without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from plait.cli import EXIT_BAD_INPUT, SUBCOMMANDS, main


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


def test_help_starts_without_torch() -> None:
    code = "import sys\nfrom plait.cli import main\nassert 'torch' not in sys.modules\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "plait", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("plait ")
