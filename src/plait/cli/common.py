"""What every ``plait`` sub-command shares: its type, the exit codes, and the error policy.

A sub-command is a function taking the arguments after its name and returning an exit
code. It reports bad input by raising :class:`~plait.errors.ConfigError`, which
:func:`run_command` prints as one paragraph (exit code 2); a rank out of memory
(:class:`~plait.errors.OutOfMemoryError`) exits 3; any other
:class:`~plait.errors.PlaitError` is a failure (exit code 1); Ctrl-C exits with 130.
This module imports no torch, so every sub-command's parser can use it.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from plait.errors import ConfigError, OutOfMemoryError, PlaitError

if TYPE_CHECKING:
    from plait.config import Config
    from plait.launch.local import RankEnv

Command = Callable[[Sequence[str]], int]
"""A sub-command: the arguments after its name -> the exit code."""

EXIT_OK = 0
EXIT_FAILURE = 1
"""A run that failed (a :class:`~plait.errors.PlaitError` other than bad input)."""
EXIT_BAD_INPUT = 2
"""Bad input (a :class:`~plait.errors.ConfigError`), as argparse's own usage errors."""
EXIT_OUT_OF_MEMORY = 3
"""A rank ran out of host or device memory (:class:`~plait.errors.OutOfMemoryError`)."""
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


def check_output_path(path: str | None, flag: str) -> None:
    """Refuse (ConfigError) an output file path that is a folder, or whose folder cannot
    be created or written, before any work is done (None: nothing to check)."""
    if not path:
        return
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file path (e.g. {p / 'out'}).")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the nearest existing ancestor: mkdir happens there
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: {parent} is a file, not a folder.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: the folder {parent} is not writable.")
    if p.exists() and not os.access(p, os.W_OK):
        raise ConfigError(f"{flag} {path} exists and is not writable.")


def _format_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    line: str | None = None,
) -> str:
    """A warning as one line, without the library's source path."""
    return f"plait: warning: {message}\n"


def run_command(command: Command, argv: Sequence[str]) -> int:
    """Run ``command(argv)`` and turn what it raises into an exit code and one message on
    stderr: ConfigError (DataError included) -> 2, OutOfMemoryError -> 3, PlaitError -> 1,
    Ctrl-C -> 130.
    Warnings are printed as ``plait: warning: ...`` lines (no source path)."""
    warnings.formatwarning = _format_warning
    sys.stdout.flush()  # nothing of stdout is left to glue onto a stderr line
    try:
        code = command(argv)
        return int(code) if code is not None else EXIT_OK
    except ConfigError as e:
        _say(f"plait: error: {e}")
        return EXIT_BAD_INPUT
    except OutOfMemoryError as e:
        _say(f"plait: out of memory: {e}")
        return EXIT_OUT_OF_MEMORY
    except PlaitError as e:
        _say(f"plait: {e}")
        return EXIT_FAILURE
    except KeyboardInterrupt:
        _say("plait: interrupted")
        return EXIT_INTERRUPTED


def _say(text: str) -> None:
    """One message on stderr on a line of its own (stdout flushed first, and a fresh line
    started, so it is never glued to a progress line)."""
    sys.stdout.flush()
    sys.stderr.write(text.rstrip("\n") + "\n")
    sys.stderr.flush()


def parse_run_flags(
    parser: argparse.ArgumentParser, rest: Sequence[str]
) -> tuple[list[str], argparse.Namespace]:
    """The dotted ``--section.field value`` overrides and the parsed named flags of a
    command that runs the model (``plait train``, ``plait eval``); an unknown flag is
    refused with the closest known one."""
    from plait.config.overrides import parse_override_flags, unknown_flag_error

    overrides, remaining = parse_override_flags(rest)
    ns, unknown = parser.parse_known_args(list(remaining))
    if unknown:
        flags = [a for a in unknown if a.startswith("-")]
        if flags:
            raise unknown_flag_error(
                flags[0], [o for a in parser._actions for o in a.option_strings]
            )
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return list(overrides), ns


def start_checks(cfg: Config) -> tuple[RankEnv | None, int]:
    """What a command that loads a model (``plait eval``, ``plait generate``) checks before
    any work: the world it runs in (torchrun's, else ``launch.nproc``), the device, the
    layout for that world, and that ``train.init_from`` exists. Returns (torchrun's
    environment or None, the world size)."""
    from plait.checkpoint import check_start
    from plait.cli.train import _check_device
    from plait.launch.local import torchrun_env
    from plait.parallel.checks import validate_run

    env = torchrun_env()
    world = env.world_size if env is not None else cfg.launch.nproc
    _check_device(cfg)
    validate_run(cfg, world)
    check_start(cfg, probe_lock=False)  # init_from exists
    return env, world


def leave_torchrun_child(env: RankEnv | None) -> None:
    """A torchrun child leaves without gloo's exit-time abort (flush, then ``_exit(0)``)."""
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_as_rank(body: Callable[..., int | None], *args: object) -> int:
    """Run a command that may be a rank (``plait train``, ``eval``, ``generate``): under
    torchrun's elastic agent ``record`` writes a failing rank's error for the parent; a
    rank of plait's own launcher turns a :class:`PlaitError` into exit 2 (bad config) or 1,
    since the launcher reports the error once (``record`` wrote it)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from plait.launch.local import torchrun_env, under_plait_launcher

    run = record(body) if torchrun_env() is not None else body
    try:
        return int(run(*args) or 0)
    except PlaitError as e:
        if not under_plait_launcher():
            raise
        return 2 if isinstance(e, ConfigError) else 1
