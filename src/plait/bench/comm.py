"""``plait bench comm``: every all-reduce algorithm of :mod:`plait.collectives.algorithms` and
the library's own all-reduce, timed on gloo ranks of this machine, with the alpha-beta
model fitted per algorithm and its prediction error beside each measurement.

For each world size a :class:`plait.testing.WorkerPool` of persistent gloo ranks runs
every algorithm on fp32 tensors from ``--min-bytes`` to ``--max-bytes`` (×``--factor``).
Sizes are the outer loop and algorithms the inner one, so drift of the machine touches
every algorithm alike. A repetition is: refill the buffer, library barrier, time the
call; its time is the slowest rank's; the table reports the median over repetitions.
Fewer repetitions at large sizes (``--reps`` up to 64 KiB, then 10, 5 and 2; at most 1
warm-up call above 8 MiB and none at the largest sizes) keep the default run under ~5
minutes on 2 cores. Once per world size the traffic of every algorithm is measured from
the comm counters, checked against the closed form (``counters = formula``) and printed
as a table of steps, per-rank, peak and total bytes (in units of S) beside the
asymptotic class (the table in docs/collectives.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from plait import comm
from plait.bench.alphabeta import LIBRARY, Measurement, fit_all, plot, summary_table, tables
from plait.bench.results import environment, load_average, write_section
from plait.collectives import algorithms as algo
from plait.collectives.costs import Cost, traffic_table
from plait.errors import ConfigError
from plait.testing import WorkerContext

BODY = "plait.bench.comm:bench_body"
PROBE_NUMEL = 840
"""fp32 elements of the traffic probe (divisible by 2..8: the table's multiples of S are
the textbook ones); an odd 1001-element probe is checked against the formula too."""


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
    """On every rank: per-repetition seconds of each (algorithm, size), and per
    algorithm the traffic counted for a :data:`PROBE_NUMEL`-element probe with whether
    the counted traffic equals the closed form (that probe and an odd one)."""
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
    traffic: dict[str, tuple[Cost | None, bool]] = {}
    for name in algorithms:
        if name != LIBRARY:  # a probe divisible by 2..8 (the table), and an odd one
            probes = [torch.randn(k, generator=gen) for k in (PROBE_NUMEL, 1001)]
            reps_ = [algo.all_reduce(x, g, name, measure=True) for x in probes]
            traffic[name] = (reps_[0].measured, all(r.measured == r.formula for r in reps_))
    return {"times": times, "traffic": traffic}


def run(
    worlds: list[int], algorithms: list[str], sizes: list[int], reps: int, timeout_s: float
) -> tuple[list[Measurement], dict[str, bool], list[Cost]]:
    """Measure every (world, size, algorithm); returns the medians, whether the counted
    traffic equals the closed form (per algorithm, every world size and rank), and the
    traffic measured from the counters for a :data:`PROBE_NUMEL`-element fp32 tensor."""
    from plait.testing import WorkerPool

    out: list[Measurement] = []
    traffic: dict[str, bool] = {}
    counted: list[Cost] = []
    for n in worlds:
        t0 = time.perf_counter()
        with WorkerPool(n, comm_timeout_s=timeout_s) as pool:
            res = pool.run(BODY, algorithms, sizes, reps, timeout_s=timeout_s * 4)
        for name, (cost, _) in res[0]["traffic"].items():
            ok = all(r["traffic"][name][1] for r in res)
            traffic[name] = traffic.get(name, True) and ok
            if cost is not None:
                counted.append(cost)
        for name in algorithms:
            for nbytes in sizes:
                per_rank = [r["times"][f"{name}/{nbytes}"] for r in res]
                slowest = [max(v) for v in zip(*per_rank, strict=True)]
                out.append(Measurement(name, n, nbytes, statistics.median(slowest), len(slowest)))
        print(f"plait bench comm: N={n} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    counted.sort(key=lambda c: (algorithms.index(c.algorithm), c.world))
    return out, traffic, counted


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
    p.add_argument(
        "--results",
        metavar="PATH",
        help="write (or replace) the 'Collective algorithms (issue 8)' section of this "
        "markdown file (benchmarks/RESULTS.md) with the summary tables",
    )
    return p


def main(argv: list[str]) -> int:
    """``plait bench comm``; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    except ValueError:
        raise ConfigError(f"--worlds takes comma-separated integers, got {args.worlds!r}") from None
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
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be positive (seconds), got {args.timeout}")
    sizes = []
    s = lo
    while s <= hi:
        sizes.append(s - s % 4)
        s *= args.factor
    t0, load0 = time.perf_counter(), load_average()
    ms, traffic, counted = run(worlds, names, sizes, args.reps, args.timeout)
    fits, fits_by_world = fit_all(ms)
    text = (
        f"Traffic of one all-reduce of S = {PROBE_NUMEL * 4} bytes (fp32), measured from "
        "the comm counters:\n\n" + traffic_table(counted, traffic) + "\n\n"
        "Timings and the alpha-beta fit:\n\n" + tables(ms, fits, fits_by_world, traffic)
    )
    print(text)
    head = _header(argv, time.perf_counter() - t0, (load0, load_average()))
    if args.md:
        title = "# All-reduce algorithms on point-to-point messages vs the alpha-beta model\n\n"
        Path(args.md).write_text(title + head + f"{text}\n")
        print(f"plait bench comm: wrote {args.md}", file=sys.stderr)
    if args.results:
        short = (
            f"Traffic of one all-reduce of S = {PROBE_NUMEL * 4} bytes (fp32), measured from "
            "the comm counters:\n\n" + traffic_table(counted, traffic) + "\n\n"
            "Alpha-beta fit per algorithm (over all world sizes and message sizes; then "
            "per world size):\n\n"
            + "\n\n".join(tables(ms, fits, fits_by_world, traffic).split("\n\n")[:2])
            + "\n\nMedian time (slowest rank) at three message sizes, the fitted model's "
            "error beside each, and the ratio to gloo's own all-reduce in the same run:\n\n"
            + summary_table(ms, fits)
        )
        _write_section(Path(args.results), head, short, args.md)
        print(f"plait bench comm: wrote its section of {args.results}", file=sys.stderr)
    if args.plot:
        plot(ms, fits, args.plot)
        print(f"plait bench comm: wrote {args.plot}", file=sys.stderr)
    return 0


def _write_section(path: Path, head: str, body: str, full: str | None) -> None:
    """Replace the issue-8 section of ``path`` (between its markers) or append it."""
    where = f" The full table (every size, per-N fits) is in `{full}`." if full else ""
    section = (
        "## Collective algorithms (issue 8)\n\n"
        "All-reduce algorithms of `plait.collectives.algorithms` on counted point-to-point "
        f"messages against gloo's own all-reduce (`library`).{where}\n\n"
        f"{head}{body}"
    )
    write_section(path, "collectives", section)


def _header(argv: list[str], seconds: float, load: tuple[float, float]) -> str:
    return (
        f"- {environment()}; "
        f"{platform.machine()} with {os.cpu_count()} cores; gloo on loopback; fp32.\n"
        f"- Command: `plait bench comm {' '.join(argv)}` ({seconds:.0f} s).\n"
        f"- Taken under load: 1-minute load average {load[0]:.1f} at the start and "
        f"{load[1]:.1f} at the end on {os.cpu_count()} cores (other jobs shared the "
        "machine); absolute times are noisy, compare algorithms within one run.\n"
        "- Traffic table: steps and bytes counted by `plait.comm` on every rank for one "
        "all-reduce, in units of S; `counters = formula` means the counted per-rank bytes, "
        "steps and critical-path bytes equal the closed form of `plait.collectives.costs` exactly "
        "(for that tensor and an odd 1001-element one, at every world size).\n"
        "- Model per algorithm: time = steps·alpha + critical_bytes·beta, with steps and "
        "critical-path bytes from `plait.collectives.costs`; `library` (gloo's all-reduce) is "
        "modelled as a ring. Fitted by least squares on the relative error over all world "
        "sizes and message sizes of that algorithm (fit table; its prediction is `model ms`, "
        "error = (model - measured) / measured), and again per algorithm and world size "
        "(per-N table and the `per-N` columns).\n"
        "- busbw uses the nccl-tests all-reduce convention algbw·2(N-1)/N for every "
        "algorithm (a normalisation, not each algorithm's own traffic).\n"
        "- `÷ library`: median time over the library all-reduce's median at the same N "
        "and size, in the same run and processes (the PyTorch reference).\n"
        "- World sizes above 2 oversubscribe 2 cores: times include CPU contention, which "
        "the alpha-beta model does not describe.\n\n"
    )
