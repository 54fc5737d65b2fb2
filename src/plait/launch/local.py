"""Start a run: N local processes through torch's elastic agent, or join torchrun's world.

``plait train --nproc N`` starts N processes on this machine with the same elastic agent
``torchrun`` uses (c10d rendezvous on a free local port, no restarts). A child that fails
stops the others, and its rank and error are reported in one paragraph. Under
``torchrun`` (single or multi node) the program finds the world in torchrun's
environment and runs as that rank directly. One process runs in this process with no
process group: the same code path with a one-rank mesh.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plait.errors import PlaitError

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
        return text or f"exit code {failure.exitcode}"
    if failure.exitcode and failure.exitcode < 0:
        return f"killed by signal {-failure.exitcode}"
    return str(msg) or f"exit code {failure.exitcode}"


def launch_local(nproc: int, args: Sequence[str]) -> None:
    """Run ``python -m plait <args>`` on ``nproc`` local ranks under the elastic agent.

    Each child finds its rank in the agent's environment, exactly as under torchrun.
    Raises :class:`LaunchError` naming the failed ranks and their errors.
    """
    import sys

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the agent's own log lines repeat the child's traceback; we report it ourselves
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        run_id=f"plait-{uuid.uuid4().hex[:8]}",
        max_restarts=0,
        start_method="spawn",
        monitor_interval=0.1,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "plait", *args)
    except ChildFailedError as e:
        raise LaunchError({r: _failure_text(f) for r, f in e.failures.items()}) from None
