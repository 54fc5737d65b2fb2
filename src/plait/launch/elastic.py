"""``plait train --nproc MIN:MAX``: a local job that shrinks to its survivors.

plait supervises the world itself: it starts MAX ranks with :func:`launch_local` (the
elastic agent, no restarts) and, when ranks die for good (killed by a signal: the
process, or its node, is gone; a rank that merely saw its peer vanish is a survivor),
replans for the ranks that are left (:func:`plait.plan.replan.replan`: the largest world
>= MIN whose allowed layout divides the global batch, gradient accumulation making up
the rest) and starts that world, which resumes from the newest step every rank's pieces
have a memory copy of (:mod:`plait.checkpoint.memory_store`; held in ``/dev/shm``, whose
lifetime is this launcher's) or, failing that, from the last disk checkpoint, and
reshards it onto the new layout. The data order is a function of (seed, step), not of
the data-parallel degree, so the run goes on as the same run: same global batch, same
samples, same losses to rounding.

Why restart the world instead of re-forming the process group in place (torchft): a
gloo or NCCL group cannot drop a member, a new one needs every survivor to rebuild its
mesh, model shards and optimizer for the new layout anyway, and a restart from copies in
shared memory costs the start of a process (milliseconds to seconds) and nothing on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from plait.checkpoint.memory_store import STORE_ENV, MemoryStore, default_root, recover
from plait.config import Config
from plait.config.rules.elastic import layout_name
from plait.errors import ConfigError, PlaitError
from plait.launch.local import LaunchError, latest_checkpoint, launch_local
from plait.plan.replan import Replan, replan

ROUND_ENV = "PLAIT_ELASTIC_ROUND"
"""How many times the job has shrunk (0: the first world), set for the ranks."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""Signals that stop a rank rather than lose it: the agent stops the survivors of a
failure with SIGTERM."""


def lost_ranks(failures: dict[int, str]) -> set[int]:
    """The ranks that are gone for good: killed by a signal other than a stop request
    (SIGKILL, SIGSEGV, SIGBUS, ...); not those that raised an error because a peer
    vanished, nor those the agent stopped."""
    stops = {f"killed by signal {int(s)}" for s in STOP_SIGNALS}
    return {r for r, t in failures.items() if t.startswith("killed by signal") and t not in stops}


def degrees_of(cfg: Config, world: int) -> dict[str, int]:
    p = cfg.parallel
    return {"dp": p.resolved_dp(world), "tp": p.tp, "pp": p.pp, "cp": p.cp}


def progress_of(metrics: str | None, since: int) -> tuple[int, float, float | None]:
    """(last step done, training seconds of the steps after ``since``, seconds since the
    last step was recorded) from rank 0's metrics file."""
    if not metrics or not Path(metrics).is_file():
        return since, 0.0, None
    last, secs = since, 0.0
    for line in Path(metrics).read_text("utf-8").splitlines():
        try:
            row: dict[str, Any] = json.loads(line)
        except ValueError:
            continue
        last = max(last, int(row["step"]))
        if int(row["step"]) > since:
            secs += float(row.get("step_seconds", 0.0))
    return last, secs, time.time() - Path(metrics).stat().st_mtime


def shrink_line(
    old: str, new: Replan, failures: dict[int, str], lost: set[int], source: str, done: int,
    resume: int, redo_s: float, idle_s: float | None,
) -> str:  # fmt: skip
    """The one log line of a shrink: old → new layout, why, step, seconds lost."""
    why = "; ".join(f"rank {r} {failures[r]}" for r in sorted(lost))
    idle = f", detected {idle_s:.1f} s after its last step" if idle_s is not None else ""
    return (
        f"plait: elastic: {old} -> {new.name} on {new.world} ranks (micro-batch "
        f"{new.micro_batch} x {new.accumulation} accumulation): {why} after step {done}{idle}; "
        f"resuming {source} at step {resume} ({done - resume} step(s), {redo_s:.2f} s of "
        "training to redo)"
    )


def grow_line(old: str, new: Replan, resume: str | None, done: int, lost_s: float) -> str:
    """The one log line of a grow: old → new layout, why, step, seconds lost."""
    return (
        f"plait: elastic: {old} -> {new.name} on {new.world} ranks (micro-batch "
        f"{new.micro_batch} x {new.accumulation} accumulation): ranks are back (SIGUSR1) "
        f"after step {done}; resuming from {resume} ({lost_s:.1f} s to stop and save)"
    )


class GrowRequest:
    """SIGUSR1 to the launcher: the ranks are back. While installed, the signal asks the
    agent to stop the ranks (SIGTERM to this process: they save at the next step
    boundary) and records that the job should grow."""

    def __init__(self, active: bool) -> None:
        self.active = active
        """Whether the job can grow (it runs on fewer ranks than launch.nproc)."""
        self.requested_at: float | None = None
        self.old: Any = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.active and self.requested_at is None:
            self.requested_at = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)

    def __enter__(self) -> GrowRequest:
        self.old = signal.signal(signal.SIGUSR1, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGUSR1, self.old)


Choose = Callable[[int], tuple[list[str], list[str]]]
"""``--layout auto``: the planner's settings for a world of N ranks and the ranks'
argument list that runs them (:func:`plait.cli.layout_auto.resolve_auto_layout`)."""


def replan_auto(
    choose: Choose, global_batch: int, high: int, low: int
) -> tuple[Replan, list[str]]:
    """The largest world in ``[low, high]`` the planner finds a layout for, as a
    :class:`Replan`, and its argument list; a :class:`ConfigError` naming each world's
    refusal when there is none."""
    why = []
    for n in range(high, low - 1, -1):
        try:
            sets, argv = choose(n)
        except ConfigError as e:
            why.append(f"{n} ranks: {e}")
            continue
        got = dict(s.split("=", 1) for s in sets)
        d = {a: int(got.get(f"parallel.{a}", 1)) for a in ("tp", "pp", "cp")}
        d["dp"] = int(got.get("parallel.dp", n // (d["tp"] * d["pp"] * d["cp"])))
        micro = int(got["train.micro_batch"])
        return Replan(n, d, micro, global_batch // (d["dp"] * micro)), argv
    raise ConfigError("--layout auto finds no layout for the ranks left: " + "; ".join(why))


def launch_elastic(
    cfg: Config, args: Sequence[str], memory_limit: int | None = None, choose: Choose | None = None
) -> int:
    """Run the job on ``launch.start_ranks`` (default ``launch.nproc``) ranks, shrinking
    to at least ``launch.min_ranks`` as ranks are lost and growing back to
    ``launch.nproc`` on SIGUSR1 (see the module docstring); returns the exit status.
    ``choose`` (``--layout auto``): the planner picks each world's layout instead of
    :func:`~plait.plan.replan.replan`."""
    t = cfg.train
    top = cfg.launch.nproc
    low = cfg.launch.min_ranks or top
    world = top
    full, top_micro = degrees_of(cfg, world), cfg.micro_batch(world)
    degrees = full
    argv, rnd = list(args), 0

    def plan_for(high: int) -> tuple[Replan, list[str]]:
        """The layout of the largest world in ``[low, high]`` and the ranks' arguments."""
        if choose is not None:
            got, base = replan_auto(choose, t.global_batch, high, low)
            return got, [*base, f"--launch.nproc={got.world}"]
        got = replan(t.global_batch, high, low, full, top_micro, cfg.launch.layouts)
        return got, [*argv, *(f"--{o}" for o in got.overrides())]

    start = cfg.launch.start_ranks or top
    if start < top:  # start smaller: the layout for `start` ranks, as after a loss
        first, argv = plan_for(start)
        world, degrees = first.world, first.degrees
    root = default_root()
    saved = {k: os.environ.get(k) for k in (STORE_ENV, ROUND_ENV)}
    os.environ[STORE_ENV] = str(root)
    try:
        while True:
            os.environ[ROUND_ENV] = str(rnd)
            try:
                with GrowRequest(active=world < top) as grow:
                    quiet = lambda: grow.requested_at is not None  # noqa: E731
                    code = launch_local(world, argv, t.checkpoint_dir, memory_limit, quiet)
                if grow.requested_at is None or code != 0:
                    return code
                plan, argv = plan_for(top)
                resume = latest_checkpoint(t.checkpoint_dir) or "none"
                done, _, _ = progress_of(cfg.log.metrics, 0)
                lost_s = time.monotonic() - grow.requested_at
                print(grow_line(layout_name(degrees), plan, resume, done, lost_s), flush=True)
                argv += ["--train.resume", resume]
                world, degrees, rnd = plan.world, plan.degrees, rnd + 1
                continue
            except LaunchError as e:
                lost = lost_ranks(e.failures)
                if not lost:
                    raise
                failures = e.failures
            survivors = world - len(lost)
            try:
                if survivors < low:
                    raise ConfigError(
                        f"only {survivors} rank(s) survive, fewer than launch.min_ranks = {low}."
                    )
                plan, argv = plan_for(survivors)
            except PlaitError as e:
                raise LaunchError(
                    {r: f"{failures[r]}; the job cannot go on: {e}" for r in sorted(lost)}
                ) from None
            rec = recover(MemoryStore(root), world, lost)
            if rec.folder is not None:
                resume, source, step = str(rec.folder), rec.why, rec.step or 0
            else:
                disk = latest_checkpoint(t.checkpoint_dir)
                where = f"the disk checkpoint {disk}" if disk else "the start (no checkpoint)"
                resume, source = disk or "none", f"from {where} ({rec.why})"
                step = int(disk.rsplit("_", 1)[-1]) if disk else 0
            done, redo_s, idle_s = progress_of(cfg.log.metrics, step)
            old = layout_name(degrees)
            print(
                shrink_line(old, plan, failures, lost, source, done, step, redo_s, idle_s),
                flush=True,
            )
            sys.stdout.flush()
            argv += ["--train.resume", resume]
            world, degrees, rnd = plan.world, plan.degrees, rnd + 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
