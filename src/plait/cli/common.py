"""What every ``plait`` sub-command shares: its type, the exit codes, and the error policy.

A sub-command is a function taking the arguments after its name and returning an exit
code. It reports bad input by raising :class:`~plait.errors.ConfigError`, which
:func:`run_command` prints as one paragraph (exit code 2); any other
:class:`~plait.errors.PlaitError` is a failure (exit code 1); Ctrl-C exits with 130.
This module imports no torch, so every sub-command's parser can use it.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from plait.errors import ConfigError, PlaitError

Command = Callable[[Sequence[str]], int]
"""A sub-command: the arguments after its name -> the exit code."""

EXIT_OK = 0
EXIT_FAILURE = 1
"""A run that failed (a :class:`~plait.errors.PlaitError` other than bad input)."""
EXIT_BAD_INPUT = 2
"""Bad input (a :class:`~plait.errors.ConfigError`), as argparse's own usage errors."""
EXIT_INTERRUPTED = 130
"""Interrupted by Ctrl-C (128 + SIGINT, as a shell reports it)."""


class ConfigErrorParser(argparse.ArgumentParser):
    """argparse that reports bad input as a :class:`~plait.errors.ConfigError` (printed as
    one paragraph with exit code 2 by :func:`run_command`) instead of exiting itself."""

    def error(self, message: str) -> NoReturn:
        hint = ""
        if message.startswith("unrecognized arguments: "):
            wrong = message.split(": ", 1)[1].split()[0].partition("=")[0]
            options = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            match = difflib.get_close_matches(wrong, options, n=1, cutoff=0.6)
            hint = f"; did you mean '{match[0]}'?" if match else ""
        raise ConfigError(f"{self.prog}: {message}{hint} (see {self.prog} --help).")


def run_command(command: Command, argv: Sequence[str]) -> int:
    """Run ``command(argv)`` and turn what it raises into an exit code and one message on
    stderr: ConfigError (DataError included) -> 2, PlaitError -> 1, Ctrl-C -> 130."""
    try:
        code = command(argv)
        return int(code) if code is not None else EXIT_OK
    except ConfigError as e:
        print(f"plait: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except PlaitError as e:
        print(f"plait: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("plait: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
