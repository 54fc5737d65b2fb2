"""``plait bench comm``: every all-reduce algorithm of :mod:`plait.comm.algorithms` and
the library's own all-reduce, timed on gloo ranks of this machine, with the alpha-beta
model fitted per algorithm and its prediction error beside each measurement.

For each world size a :class:`plait.testing.WorkerPool` of persistent gloo ranks runs
every algorithm on fp32 tensors from ``--min-bytes`` to ``--max-bytes`` (×``--factor``).
Sizes are the outer loop and algorithms the inner one, so drift of the machine touches
every algorithm alike. A repetition is: refill the buffer, library barrier, time the
call; its time is the slowest rank's; the table reports the median over repetitions.
Fewer repetitions at large sizes (``--reps`` up to 64 KiB, then 10, 5 and 2; at most 1
warm-up call above 8 MiB and none at the largest sizes) keep the default run under ~5
minutes on 2 cores. Once per world size the traffic measured from the comm counters is
checked against the closed form (``counters = formula``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from plait import comm
from plait.bench.alphabeta import LIBRARY, Measurement, fit_all, plot, tables
from plait.comm import algorithms as algo
from plait.errors import ConfigError
from plait.testing import WorkerContext

BODY = "plait.bench.comm:bench_body"


def _parse_bytes(text: str) -> int:
    """4, 32K, 64M, 64MiB -> bytes."""
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    mult = {"k": 2**10, "m": 2**20, "g": 2**30}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    if not digits.isdigit():
        raise ConfigError(f"cannot read a byte size from {text!r}; write e.g. 4, 32K or 64M")
    return int(digits) * mult


def plan(nbytes: int, reps: int) -> tuple[int, int]:
    """(warm-up calls, timed repetitions) for a message of ``nbytes``."""
    if nbytes <= 64 * 2**10:
        return 2, reps
    if nbytes <= 2**20:
        return 1, min(reps, 10)
    if nbytes <= 8 * 2**20:
        return 1, min(reps, 5)
    return 0, min(reps, 2)


def bench_body(
    ctx: WorkerContext, algorithms: list[str], sizes: list[int], reps: int
) -> dict[str, Any]:
    """On every rank: per-repetition seconds of each (algorithm, size), and whether the
    counted traffic equals the closed form."""
    g = ctx.mesh(dp=ctx.world_size).axis("dp")
    gen = torch.Generator().manual_seed(ctx.rank)
    times: dict[str, list[float]] = {}
    for nbytes in sizes:
        x = torch.randn(max(1, nbytes // 4), generator=gen)  # (numel,) fp32
        buf = torch.empty_like(x)
        warm, n = plan(nbytes, reps)
        for name in algorithms:
            ts = []
            for i in range(warm + n):
                buf.copy_(x)
                comm.barrier(g)
                t0 = time.perf_counter()
                if name == LIBRARY:
                    comm.all_reduce(buf, g)
                else:
                    algo.all_reduce(buf, g, name, check_shapes=False)
                dt = time.perf_counter() - t0
                if i >= warm:
                    ts.append(dt)
            times[f"{name}/{nbytes}"] = ts
        del x, buf
    traffic = {}
    probe = torch.randn(1001, generator=gen)
    for name in algorithms:
        if name != LIBRARY:
            rep = algo.all_reduce(probe.clone(), g, name, measure=True)
            traffic[name] = rep.measured == rep.formula
    return {"times": times, "traffic": traffic}


def run(
    worlds: list[int], algorithms: list[str], sizes: list[int], reps: int, timeout_s: float
) -> tuple[list[Measurement], dict[str, bool]]:
    """Measure every (world, size, algorithm); returns the medians and traffic checks."""
    from plait.testing import WorkerPool

    out: list[Measurement] = []
    traffic: dict[str, bool] = {}
    for n in worlds:
        t0 = time.perf_counter()
        with WorkerPool(n, comm_timeout_s=timeout_s) as pool:
            res = pool.run(BODY, algorithms, sizes, reps, timeout_s=timeout_s * 4)
        for name in res[0]["traffic"]:
            traffic[name] = traffic.get(name, True) and all(r["traffic"][name] for r in res)
        for name in algorithms:
            for nbytes in sizes:
                per_rank = [r["times"][f"{name}/{nbytes}"] for r in res]
                slowest = [max(v) for v in zip(*per_rank, strict=True)]
                out.append(Measurement(name, n, nbytes, statistics.median(slowest), len(slowest)))
        print(f"plait bench comm: N={n} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out, traffic


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plait bench comm",
        description="Time the point-to-point all-reduce algorithms and the library "
        "all-reduce, fit the alpha-beta model, print the table (optionally write it "
        "and a plot).",
    )
    p.add_argument("--worlds", default="2,4,8", help="world sizes (default 2,4,8)")
    p.add_argument(
        "--algorithms", default="all", help=f"comma list of {sorted(algo.ALL_REDUCE)} and 'library'"
    )
    p.add_argument("--min-bytes", default="4", help="smallest message (default 4)")
    p.add_argument("--max-bytes", default="64M", help="largest message (default 64M)")
    p.add_argument("--factor", type=int, default=8, help="size step factor (default 8)")
    p.add_argument("--reps", type=int, default=15, help="repetitions up to 64 KiB (default 15)")
    p.add_argument("--timeout", type=float, default=300.0, help="comm timeout in seconds")
    p.add_argument("--md", metavar="PATH", help="write the tables to this markdown file")
    p.add_argument("--plot", metavar="PATH", help="write the log-log plot to this PNG")
    return p


def main(argv: list[str]) -> int:
    """``plait bench comm``; returns the exit code."""
    args = _parser().parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    names = [*algo.ALL_REDUCE, LIBRARY] if args.algorithms == "all" else args.algorithms.split(",")
    bad = [n for n in names if n not in algo.ALL_REDUCE and n != LIBRARY]
    if bad or not worlds or min(worlds) < 2 or args.factor < 2 or args.reps < 1:
        raise ConfigError(
            f"bad benchmark arguments: algorithms {bad or 'ok'}, worlds {worlds} (each >= 2), "
            f"factor {args.factor} (>= 2), reps {args.reps} (>= 1); algorithms are "
            f"{sorted(algo.ALL_REDUCE)} and 'library'"
        )
    lo, hi = _parse_bytes(args.min_bytes), _parse_bytes(args.max_bytes)
    if lo < 4 or hi < lo:
        raise ConfigError(f"need 4 <= --min-bytes <= --max-bytes, got {lo} and {hi}")
    sizes = []
    s = lo
    while s <= hi:
        sizes.append(s - s % 4)
        s *= args.factor
    t0 = time.perf_counter()
    ms, traffic = run(worlds, names, sizes, args.reps, args.timeout)
    fits, fits_by_world = fit_all(ms)
    text = tables(ms, fits, fits_by_world, traffic)
    print(text)
    if args.md:
        Path(args.md).write_text(_document(text, argv, time.perf_counter() - t0))
        print(f"plait bench comm: wrote {args.md}", file=sys.stderr)
    if args.plot:
        plot(ms, fits, args.plot)
        print(f"plait bench comm: wrote {args.plot}", file=sys.stderr)
    return 0


def _document(text: str, argv: list[str], seconds: float) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        "# All-reduce algorithms on point-to-point messages vs the alpha-beta model\n\n"
        f"- Date: {now}; torch {torch.__version__}; Python {platform.python_version()}; "
        f"{platform.machine()} with {os.cpu_count()} cores; gloo on loopback; fp32.\n"
        f"- Command: `plait bench comm {' '.join(argv)}` ({seconds:.0f} s).\n"
        "- Model per algorithm: time = steps·alpha + critical_bytes·beta, with steps and "
        "critical-path bytes from `plait.comm.costs`; `library` (gloo's all-reduce) is "
        "modelled as a ring. Fitted by least squares on the relative error over all world "
        "sizes and message sizes of that algorithm (first table; its prediction is `model ms`, "
        "error = (model - measured) / measured), and again per algorithm and world size "
        "(second table, `per-N` columns).\n"
        "- busbw uses the nccl-tests all-reduce convention algbw·2(N-1)/N for every "
        "algorithm (a normalisation, not each algorithm's own traffic).\n"
        "- World sizes above 2 oversubscribe 2 cores: times include CPU contention, which "
        "the alpha-beta model does not describe.\n\n"
        f"{text}\n"
    )
