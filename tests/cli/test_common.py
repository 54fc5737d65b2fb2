"""The error policy every sub-command shares: what it raises -> exit code and one line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from plait.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    Command,
    ConfigErrorParser,
    run_command,
)
from plait.errors import ConfigError, DataError, PlaitError


def _raising(exc: BaseException) -> Command:
    def command(argv: Sequence[str]) -> int:
        raise exc

    return command


@pytest.mark.parametrize(
    ("exc", "code", "message"),
    [
        (ConfigError("train.steps must be positive"), EXIT_BAD_INPUT, "plait: error: train.steps"),
        (DataError("corpus too small"), EXIT_BAD_INPUT, "plait: error: corpus too small"),
        (PlaitError("rank 1 failed"), EXIT_FAILURE, "plait: rank 1 failed"),
        (KeyboardInterrupt(), EXIT_INTERRUPTED, "plait: interrupted"),
    ],
)
def test_errors_become_exit_codes_and_one_line(
    capsys: pytest.CaptureFixture[str], exc: BaseException, code: int, message: str
) -> None:
    assert run_command(_raising(exc), []) == code
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err


def test_return_value_is_the_exit_code_and_none_is_success() -> None:
    seen: list[Sequence[str]] = []

    def command(argv: Sequence[str]) -> int:
        seen.append(argv)
        return 3

    assert run_command(command, ["a", "b"]) == 3 and seen == [["a", "b"]]

    def silent(argv: Sequence[str]) -> Any:
        return None

    assert run_command(silent, []) == EXIT_OK


def test_other_exceptions_are_not_swallowed() -> None:
    with pytest.raises(ValueError, match="a bug"):
        run_command(_raising(ValueError("a bug")), [])


def test_parser_errors_are_config_errors_naming_the_command() -> None:
    p = ConfigErrorParser(prog="plait thing")
    p.add_argument("--n", type=int)
    with pytest.raises(ConfigError, match=r"^plait thing: .*--bogus \(see plait thing --help\)"):
        p.parse_args(["--bogus"])
