"""Start a run: N local processes through torch's elastic agent, or join torchrun's world.

``plait train --nproc N`` starts N processes on this machine with the same elastic agent
``torchrun`` uses (c10d rendezvous on a free local port, no restarts). A child that fails
stops the others, and its rank and error are reported in one paragraph. Under
``torchrun`` (single or multi node) the program finds the world in torchrun's
environment and runs as that rank directly. One process runs in this process with no
process group: the same code path with a one-rank mesh.

Errors a rank finds after the launch are reported once, by the launcher: a bad input
(a :class:`~plait.errors.ConfigError` on any rank, e.g. a checkpoint folder held by
another job) as that one message with exit status 2, anything else as one paragraph
naming each failed rank (exit 1), a rank out of host or device memory as that, with
every rank's peak memory and what to try (exit 3, :mod:`plait.launch.oom`); the ranks
themselves stay quiet
(:func:`under_plait_launcher`). SIGTERM or SIGINT to the launcher is forwarded to every
rank; they save a checkpoint at the next step boundary and the launcher prints one line
naming it and exits 0 (128 + the signal when nothing was saved). Every rank dies with
its launcher (:mod:`plait.launch.parent`).
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.errors import PlaitError
from plait.launch import oom

RUN_ID_PREFIX = "plait-"
"""Run ids of :func:`launch_local`'s jobs start with it (how a rank knows its launcher)."""
RANK_PROGRAM: tuple[str, ...] = ("-m", "plait")
"""What each local rank runs (``python -m plait <args>``); a test's fixture may point it
at its own entry (one that kills a rank at a chosen step)."""
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in a torchrun world."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_env(environ: Mapping[str, str] | None = None) -> RankEnv | None:
    """The world torchrun (or the elastic agent) set up for this process, if any."""
    env = os.environ if environ is None else environ
    if not all(v in env for v in _TORCHRUN_VARS):
        return None
    return RankEnv(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env["LOCAL_RANK"]),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
    )


class LaunchError(PlaitError, RuntimeError):
    """One or more local ranks failed; the message names each rank and its error."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        lines = [f"{len(failures)} rank(s) failed:"]
        lines += [f"  rank {r}: {msg}" for r, msg in sorted(failures.items())]
        super().__init__("\n".join(lines))


def _failure_text(failure: Any) -> str:
    """The error of one failed child, with the last frame of its traceback."""
    data = failure.error_file_data or {}
    msg = data.get("message", data)
    if isinstance(msg, dict):
        text = str(msg.get("message", ""))
        stack = str(msg.get("extraInfo", {}).get("py_callstack", ""))
        frames = [ln.strip() for ln in stack.splitlines() if ln.strip().startswith("File ")]
        if frames:
            text += f" (at {frames[-1]})"
        if not text and failure.exitcode and failure.exitcode < 0:
            return f"killed by signal {-failure.exitcode}"
        return text or f"exit code {failure.exitcode}"
    if failure.exitcode and failure.exitcode < 0:
        return f"killed by signal {-failure.exitcode}"
    return str(msg) or f"exit code {failure.exitcode}"


def _bad_input_names() -> set[str]:
    """Class names of every ConfigError (bad input: exit 2) known to this process."""
    import plait.checkpoint  # noqa: F401  (registers the checkpoint errors)
    from plait.errors import ConfigError

    seen: set[str] = set()
    todo: list[type] = [ConfigError]
    while todo:
        c = todo.pop()
        if c.__name__ not in seen:
            seen.add(c.__name__)
            todo += c.__subclasses__()
    return seen


def launch_failure(failures: dict[int, str]) -> PlaitError:
    """The one error to report for failed ranks: the first rank's bad-input error (a
    ConfigError, exit 2; the others failed because of it or with the same message), or a
    :class:`LaunchError` naming every rank."""
    from plait.errors import ConfigError

    bad = _bad_input_names()
    for r in sorted(failures):
        kind, sep, text = failures[r].partition(": ")
        if sep and kind in bad:
            text = text.split(" (at File ")[0]
            return ConfigError(text if text.startswith("rank") else f"rank {r}: {text}")
    return LaunchError(failures)


def child_failure(
    failures: dict[int, str],
    memory_dir: Path,
    kills_before: int | None,
    since_s: float = 0.0,
    memory_limit: int | None = None,
) -> PlaitError:
    """The one error for failed ranks: out of memory (:func:`plait.launch.oom.name_oom`,
    from the kernel's record and the ranks' memory reports in ``memory_dir``) when a rank
    died of it (``since_s``: when the run started, seconds since boot; ``memory_limit``:
    the host's limit in bytes when the user gave it), else :func:`launch_failure`."""
    sig9 = any(t == "killed by signal 9" for t in failures.values())
    named = oom.name_oom(
        failures,
        oom.read_reports(memory_dir),
        kills_before,
        oom.cgroup_oom_kills(),
        oom.kernel_killed_pids(since_s) if sig9 else {},
        oom.host_memory_limit(memory_limit),
    )
    return named if named is not None else launch_failure(failures)


def latest_checkpoint(checkpoint_dir: str | None) -> str | None:
    """The folder ``checkpoint_dir``'s ``latest`` names, or None."""
    if not checkpoint_dir:
        return None
    from plait.checkpoint import read_latest

    try:
        p = read_latest(Path(checkpoint_dir))
    except OSError:
        return None
    return str(p) if p is not None else None


def stopped_line(sig: int, checkpoint_dir: str | None, before: str | None) -> tuple[int, str]:
    """(exit status, the one line) of a run stopped by ``sig`` sent to the launcher: 0 and
    the checkpoint the ranks saved, or 128 + sig when none was saved."""
    import signal

    name = signal.Signals(sig).name
    now = latest_checkpoint(checkpoint_dir)
    if now is not None and now != before:
        return 0, f"plait: stopped by {name}; the ranks saved checkpoint {now} (--resume goes on)"
    if not checkpoint_dir:
        return 128 + sig, f"plait: stopped by {name}; no checkpoint (no train.checkpoint_dir)"
    return 128 + sig, f"plait: stopped by {name} before the ranks could save a checkpoint"


def launch_local(
    nproc: int,
    args: Sequence[str],
    checkpoint_dir: str | None = None,
    memory_limit: int | None = None,
    quiet_stop: Callable[[], bool] | None = None,
) -> int:
    """Run ``python -m plait <args>`` on ``nproc`` local ranks under the elastic agent;
    returns the exit status.

    Each child finds its rank in the agent's environment, exactly as under torchrun.
    SIGTERM/SIGINT to this process are forwarded to the ranks by the agent; they save a
    checkpoint (in ``checkpoint_dir``) at the next step boundary and this returns 0 after
    printing one line naming it. Raises :class:`LaunchError` naming the failed ranks and
    their errors, one ConfigError (exit 2) when a rank's error was bad input, or
    :class:`~plait.errors.OutOfMemoryError` (exit 3) when a rank ran out of memory
    (``memory_limit``: the host memory in bytes the ranks may use together, when known
    better than the machine says: ``launch.host_memory_gb``).
    """
    import sys

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from plait.launch.rendezvous_events import speed_up_event_names

    speed_up_event_names()  # seconds of CPU per launch otherwise (see there)

    # the agent's own log lines repeat the child's traceback; we report it ourselves
    # (and "Received 15 death signal": the launcher says what happened in one line)
    for name in [
        "torch.distributed.elastic",
        "torch.multiprocessing",
        *logging.root.manager.loggerDict,
    ]:
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        run_id=f"{RUN_ID_PREFIX}{uuid.uuid4().hex[:8]}",
        max_restarts=0,
        start_method="spawn",
        monitor_interval=0.1,
    )
    before = latest_checkpoint(checkpoint_dir)
    kills_before, since_s = oom.cgroup_oom_kills(), oom.uptime_s()
    with tempfile.TemporaryDirectory(prefix="plait-memory-") as memory_dir:
        saved = os.environ.get(oom.MEMORY_DIR_ENV)
        os.environ[oom.MEMORY_DIR_ENV] = memory_dir  # the ranks report their memory here
        try:
            elastic_launch(config, sys.executable)(*RANK_PROGRAM, *args)
        except ChildFailedError as e:
            failures = {r: _failure_text(f) for r, f in e.failures.items()}
            raise child_failure(
                failures, Path(memory_dir), kills_before, since_s, memory_limit
            ) from None
        except SignalException as e:  # the agent forwarded it and waited for the ranks
            code, line = stopped_line(int(e.sigval), checkpoint_dir, before)
            sys.stdout.flush()
            if quiet_stop is None or not quiet_stop():  # (an elastic launcher's own stop)
                print(line, flush=True)
            return code
        finally:
            if saved is None:
                os.environ.pop(oom.MEMORY_DIR_ENV, None)
            else:
                os.environ[oom.MEMORY_DIR_ENV] = saved
    return 0


def under_plait_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a rank started by :func:`launch_local` (which reports
    the ranks' errors once itself)."""
    env = os.environ if environ is None else environ
    return env.get("TORCHELASTIC_RUN_ID", "").startswith(RUN_ID_PREFIX)
