"""Faults: lost and hung ranks, stop signals, stragglers, elastic restart.

* A rank that dies (SIGKILL) or hangs (SIGSTOP) mid-run: the survivor's next collective
  raises CommError at once / CommTimeoutError after the group timeout (2 s here),
  naming rank, axis and operation, instead of hanging. Fresh forked processes (a pool
  worker cannot be killed without breaking the pool).
* A straggler: rank 1 does extra matrix products (deterministic work, ~10x its step)
  inside every step; it is reported with a factor above train.straggler_factor in the
  metrics and the log, rank 0 never is.
* Elastic restart: ``torchrun --max-restarts 1`` with rank 1 killing itself at step 5
  (by the fixture ``fault_entry.py``); the agent restarts the job, which resumes from the step-4
  checkpoint and ends with the same final loss as an uninterrupted run.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.config import Config, DataConfig, LogConfig, ModelConfig, TrainConfig
from plait.errors import CommError, CommTimeoutError
from plait.testing import WorkerContext, WorkerPool
from plait.train.faults import StopSignals, find_stragglers
from plait.train.trainer import Trainer
from tests.tiny import tiny_args

M = "tests.train.test_faults"
FAULT_ENTRY = Path(__file__).with_name("fault_entry.py")


def test_find_stragglers_against_the_lower_median() -> None:
    assert find_stragglers([0.1, 0.1, 0.1, 0.5], 2.0)[0].rank == 3
    (s,) = find_stragglers([0.1, 0.35], 2.0)  # two ranks: compared with the faster one
    assert (s.rank, round(s.factor, 6)) == (1, 3.5)
    assert str(s) == "straggler(rank=1, factor=3.50)"
    assert find_stragglers([0.1, 0.15, 0.12], 2.0) == []
    assert find_stragglers([0.1, 5.0], 0.0) == []  # off


def test_pipeline_stages_are_compared_only_within_themselves() -> None:
    # pp2 x dp2: ranks {0, 1} are stage 0, {2, 3} the (heavier) last stage
    times = [0.1, 0.1, 0.5, 0.5]
    assert find_stragglers(times, 2.0, groups=[[0, 1], [2, 3]]) == []
    assert [s.rank for s in find_stragglers(times, 2.0)] == [2, 3]  # one group: flagged
    (s,) = find_stragglers([0.1, 0.1, 0.5, 1.5], 2.0, groups=[[0, 1], [2, 3]])
    assert (s.rank, round(s.factor, 6)) == (3, 3.0)
    assert find_stragglers([0.1, 0.9], 2.0, groups=[[0], [1]]) == []  # pp2, dp1


def test_stop_signals_set_a_flag_and_are_restored() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        assert stop.requested is None
        signal.raise_signal(signal.SIGTERM)  # handled: the process goes on
        assert stop.requested == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


# ---------------------------------------------------------------------------- lost ranks


def _pair(rank: int, store: str, mode: str, conn: Any) -> None:
    torch.set_num_threads(1)
    from plait import comm
    from plait.mesh import init_mesh

    comm.init_world("gloo", rank, 2, f"file://{store}", timeout_s=2.0)
    mesh = init_mesh(dp=2, timeout_s=2.0)
    t = torch.ones(4)
    comm.all_reduce(t, mesh.axis("dp"))  # both alive
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL if mode == "dead" else signal.SIGSTOP)
    t0 = time.perf_counter()
    try:
        comm.all_reduce(t, mesh.axis("dp"))
        conn.send(("no error", "", time.perf_counter() - t0))
    except Exception as e:
        conn.send((type(e).__name__, str(e), time.perf_counter() - t0))
    os._exit(0)


@pytest.mark.parametrize(("mode", "error"), [("dead", CommError), ("hung", CommTimeoutError)])
def test_survivor_raises_within_the_timeout(tmp_path: Path, mode: str, error: type) -> None:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    procs = [
        ctx.Process(target=_pair, args=(r, str(tmp_path / "store"), mode, child)) for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        assert parent.poll(60), "the survivor neither finished nor failed"
        kind, msg, seconds = parent.recv()
    finally:
        for p in procs:
            p.kill()
            p.join(10)
    assert kind == error.__name__, msg
    assert "rank 0" in msg and "all_reduce on mesh axis 'dp'" in msg
    assert seconds < 2.0 + 1.5  # the group timeout, plus slack for a loaded machine


# ---------------------------------------------------------------------------- stragglers


def _tiny(steps: int, **train: Any) -> Config:
    return Config(
        model=ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32),
        train=TrainConfig(
            steps=steps,
            global_batch=8,
            seq_len=32,
            warmup_steps=2,
            eval_every=0,
            eval_batches=1,
            **train,
        ),
        data=DataConfig(max_bytes=100_000),
        log=LogConfig(progress="lines", peak_tflops=1.0),
    )


def _body_straggler(ctx: WorkerContext, metrics: str) -> tuple[dict[int, int], list[str]]:
    cfg = _tiny(4, straggler_factor=2.0)
    cfg.log.metrics = metrics
    tr = Trainer(cfg, ctx.mesh(dp=ctx.world_size))
    log: list[str] = []
    message = tr.progress.message

    def logged(text: str) -> None:
        log.append(text)
        message(text)

    tr.progress.message = logged  # type: ignore[method-assign]
    if ctx.rank == 1:  # deterministic extra work inside every step: a slow rank
        loss = tr.model.loss_fn
        a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))

        def slow(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            for _ in range(400):
                torch.mm(a, a)
            return loss(x, y)

        tr.model.loss_fn = slow
    tr.run()
    return tr.faults.reported, log


def test_slow_rank_is_reported_as_straggler(
    pools: Callable[[int], WorkerPool], tmp_path: Path
) -> None:
    metrics = tmp_path / "m.jsonl"
    results = pools(2).run(f"{M}:_body_straggler", str(metrics))
    reported = [r for r, _ in results]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    flagged = [r["stragglers"] for r in rows if r["stragglers"]]
    assert len(flagged) >= 3, rows  # of 4 steps (one may be lost to the machine's load)
    assert all([s["rank"] for s in f] == [1] and f[0]["factor"] > 2.0 for f in flagged)
    assert all(r == {1: len(flagged)} for r in reported)  # every rank saw the same
    lines = [t for t in results[0][1] if "straggler(rank=1, factor=" in t]
    assert len(lines) == 1 and "later straggler steps are only counted" in lines[0]  # once
    (total,) = [t for t in results[0][1] if t.startswith("plait: stragglers on ")]
    assert total.startswith(f"plait: stragglers on {len(flagged)} steps (rank 1: {len(flagged)})")


# ---------------------------------------------------------------------------- restart

TORCHRUN_ARGS = [
    *tiny_args(max_bytes=100_000),
    *["--train.warmup_steps", "2", "--steps", "6", "--launch.threads", "1"],  # as the pool
]


def _body_uninterrupted(ctx: WorkerContext) -> list[float]:
    from plait.config.overrides import parse_override_flags
    from plait.config.toml_io import load_config

    overrides, rest = parse_override_flags(TORCHRUN_ARGS)
    assert rest == []
    cfg = load_config(None, overrides)
    cfg.log.progress = "none"
    return Trainer(cfg, ctx.mesh(dp=ctx.world_size), show_progress=False).run().losses


@pytest.mark.slow
def test_killed_rank_restarts_and_resumes_under_torchrun(
    pools: Callable[[int], WorkerPool], tmp_path: Path
) -> None:
    metrics = tmp_path / "m.jsonl"
    args = [
        *TORCHRUN_ARGS,
        *["--train.checkpoint_every", "2", "--parallel.timeout_s", "30"],
        *("--train.checkpoint_dir", str(tmp_path / "ck"), "--metrics", str(metrics)),
    ]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--monitor-interval",
            "0.1",
            str(FAULT_ENTRY),
            "1",  # the rank to kill
            "5",  # at step 5 of the first attempt
            *args,
        ],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]  # 5, 6: after the restart
    assert "resumed from" in r.stdout
    want = pools(2).run(f"{M}:_body_uninterrupted")[0]
    assert rows[-1]["loss"] == want[-1]


def _body_monitor_bytes(ctx: WorkerContext) -> tuple[float, int, list[float], bool]:
    from plait.train.faults import FaultMonitor

    mesh = ctx.mesh(dp=ctx.world_size)
    monitor = FaultMonitor(_tiny(1, straggler_factor=2.0), mesh)
    mesh.stats.reset()
    health = monitor.after_step(0.25 * (ctx.rank + 1), 0.0)
    ops = mesh.stats.snapshot()
    return mesh.stats.total_bytes(), sum(int(v["calls"]) for v in ops.values()), (
        health.compute_s
    ), health.stop


def test_monitor_moves_16_bytes_per_rank(pools: Callable[[int], WorkerPool]) -> None:
    """One all-gather per step of (compute seconds, stop flag) float64 per rank: bus bytes
    from the comm counters = (N-1)/N · 16N; every rank gets every rank's compute time."""
    n = 4
    for total, calls, compute, stop in pools(n).run(f"{M}:_body_monitor_bytes"):
        assert calls == 1
        assert total == 16 * (n - 1)
        assert compute == [0.25 * (r + 1) for r in range(n)]
        assert stop is False
