"""The planner's predictions against real runs on this machine, and against published runs.

Part 1 (measured here). Every layout of :data:`plait.bench.planner_rows.ROWS` trains the
built-in ``small`` model (0.87 M parameters, fp32, AdamW) with plait's own
:class:`~plait.train.trainer.Trainer` on the built-in corpus, in a pool of gloo ranks of
one thread each (:func:`plait.bench.planner_measure.measure_body`). Just before the
steps the same ranks calibrate the machine all at once (:func:`plait.bench.calibrate.
calibrate_body`: matmul, attention and element-wise rates, operator overhead, optimizer
rate, alpha-beta fits of the collectives at this rank count, and the in-step cost of a
tensor-parallel all-reduce on pairs of ranks), and re-measure the compute
rates just after; each rate is timed on two clocks, wall and process CPU time. For each
layout the script prints

* rank 0's **state bytes** (weights, gradients, fp32 masters, AdamW state, exactly as
  :func:`plait.train.memory.memory_report` reads them from the tensors; plait's
  gradients are views into its data-parallel buckets, so the buckets count as the
  gradients) and the **bucket** bytes beyond the gradients they hold (a runtime whose
  buckets copy the gradients), against the planner (pipeline stage 0, shard 0), filed
  the same way on both sides;
* **activation bytes** of one micro-batch on rank 0's stage, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (unique storages, parameters and buffers
  excluded), against the planner's list of saved tensors for plait's block (see
  :mod:`plait.plan.activations`) and, for scale, Korthikanti et al.'s 16-bit-with-
  dropout formula per layer (with the planner's embedding/head terms);
* **step time**: the median over steps of the slowest rank's ``Trainer.train_step``
  (after a barrier), in process CPU time against the planner with the CPU-time profile
  (less the pipeline bubble, during which a rank sleeps in a receive and its CPU
  time does not advance), and in wall time against the planner with the wall-clock
  profile. The machine is
  shared: CPU time is blind to the time other jobs take the cores (and to ranks
  oversubscribing them), wall time is not; the load average is recorded per row.

With ``--shapes N --seed S`` (issue 46) the same nine layouts run on each of N model shapes
drawn away from every calibration point (:mod:`plait.bench.random_shapes`: hidden sizes
40-400, head dimensions 16-48, sequences 64-320, micro-batches 1-8, 2-6 layers, each shape
outside the block grid's range in its hidden size or its tokens per micro-batch), each
layout keeping its micro-batches per step at the shape's micro-batch
(:meth:`plait.bench.planner_rows.Row.at`). It prints the step-time error distribution per
layout (median |error|, worst, cells within 20 %) on both clocks and, in CPU time, without
the block grids (do they earn their place off the grid?), the CPU-time error of every
cell, and each shape's full table (state and activation bytes included); part 2 is left
out.

Layouts the runtime does not run yet (:func:`plait.parallel.checks.validate_run` refuses
them) are listed as "not yet available"; they become measured rows as soon as it does.

Part 2 (published, :mod:`plait.bench.published_runs`). The planner's utilisation for large
runs whose configuration the papers state, with the datasheet presets, against the
reported figure.

Run from the repository root::

    python benchmarks/planner_vs_measured.py                       # print
    python benchmarks/planner_vs_measured.py --out benchmarks/RESULTS.md  # its section
    python benchmarks/planner_vs_measured.py --shapes 5 --seed 0 --steps 5  # off the grid
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from plait.bench.planner_rows import MODEL, ROWS, SEQ, Row, available, rows_at
from plait.bench.published_runs import published_table
from plait.bench.random_shapes import Shape, draw_shapes
from plait.bench.results import wait_quiet

BODY = "plait.bench.planner_measure:measure_body"
COMPUTE_BODY = "plait.bench.measure:compute_body"
TP_GRID_BODY = "plait.bench.tp_block:grid_body"
CALIBRATE_BODY = "plait.bench.calibrate:calibrate_body"
QUIET = 0.10
"""Background CPU use (fraction of all cores) below which a measurement starts."""

# --------------------------------------------------------------------------- parent side


def predict(row: Row, hw: Any) -> Any:
    """The planner's estimate for ``row``: the config mapped exactly as ``plait train``'s
    memory check maps it (:func:`plait.plan.fit.plan_inputs`)."""
    from plait.plan import Query, estimate
    from plait.plan.fit import plan_inputs

    spec, layout, precision, runtime = plan_inputs(row.full_config(), row.world)
    return estimate(Query.of_layout(spec, layout, hw, precision, runtime, row.seq, 0.0), layout)


def korthikanti_bytes(row: Row, e: Any) -> float:
    """Korthikanti et al.'s per-layer formula (16-bit, dropout, unfused attention) x the
    layers of pipeline stage 0, plus the planner's embedding/head terms of that stage."""
    from plait.plan.activations import (
        embedding_activation_bytes,
        head_activation_bytes,
        korthikanti_layer_bytes,
    )
    from plait.plan.memory import stage_layers

    s, lay = e.model, e.layout
    t, sp = lay.tp, lay.sequence_parallel
    per_layer = korthikanti_layer_bytes(row.seq, lay.micro_batch, s.hidden, s.n_heads, t, sp)
    edge = embedding_activation_bytes(e.query, lay)
    if lay.pp == 1:
        edge += head_activation_bytes(e.query, lay)
    return stage_layers(s.n_layers, lay.pp, 0) * per_layer + edge


def _err(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.1f}%"


def _mb(n: float) -> str:
    return f"{n / 2**20:.3f}"


def profile_here(pool: Any, hw: Any, quick: bool = False) -> tuple[Any, list[dict[str, Any]]]:
    """``hw`` re-measured on ``pool``'s ranks, all at once: the compute rates, and the
    collectives' alpha-beta fits at this rank count (ranks share the cores, so both
    depend on how many run); ``quick``: the calibration's short form."""
    from plait.bench.calibrate import profile_from_results

    res = pool.run(CALIBRATE_BODY, quick, timeout_s=600.0)
    here, _ = profile_from_results(res, hw.memory_bytes, hw.name)
    return here, res


def _block_ratio(e: Any) -> float:
    """The ratio the planner multiplies ``e``'s blocks by: the profile's tensor-parallel
    block grid at a tp-2 layout (compute and collectives), else its block composition
    ratio, at the block's hidden size and tokens per micro-batch and rank."""
    from plait.plan.overheads import block_scale, tp_block_ratio

    lay = e.layout
    tokens = lay.micro_batch * e.query.seq_len / lay.cp
    tp = tp_block_ratio(e.hardware, lay, e.model.hidden, tokens)
    return block_scale(e.hardware, e.model.hidden, tokens) if tp is None else tp


TABLE_HEAD = [
    "| layout | state MiB pred / meas | err | DP buckets MiB pred / meas | "
    "activations MiB meas | plait fp32 pred (err) | Korthikanti pred (err) | "
    "CPU ms/step pred / meas | err | wall ms/step pred / meas | err | load |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
]
PARTS_HEAD = [
    "| layout | compute | TP comm | CP comm | PP comm + bubble | "
    "DP/ZeRO comm exposed (total) | optimizer | other | predicted (no bubble) | "
    "measured | block ratio | predicted without it (err) |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
]
PARTS_NOTE = (
    "Predicted CPU time per step by component (ms); block ratio: the calibrated "
    "ratio the blocks are charged, interpolated at the row's hidden size and tokens per "
    "micro-batch: the block composition ratio (`Hardware.block_scale`), or for tp = 2 "
    "the tensor-parallel block grid's (`tp_block_scale`, `sp_block_scale`), which also "
    "multiplies the blocks' TP collectives; without it: the profile with no grid:"
)


@dataclass(frozen=True)
class Measured:
    """One row's comparison: its line in each table and its step-time errors."""

    line: str
    part: str | None
    cpu_err: float | None
    """(predicted - measured) / measured CPU time per step; None: not run."""
    wall_err: float | None
    """The same in wall time."""
    plain_err: float | None
    """The CPU-time error of the profile without its block grids (block ratio 1)."""


def measure_row(
    row: Row, hw: Any, pools: dict[int, Any], steps: int, warmup: int, max_wait_s: float,
    quick: bool,
) -> Measured:  # fmt: skip
    """Run ``row`` on a pool of ``pools`` (started on first use, kept for the next rows)
    and compare it with the planner (``quick``: the short forms of the calibration and
    of the rate measurements)."""
    from plait.bench.calibrate import profile_from_results
    from plait.bench.results import load_average
    from plait.bench.tp_block import mean_grids
    from plait.plan.memory import copies_gradients, stage_memory, stage_params
    from plait.testing import WorkerPool

    if available(row) is not None:
        line = f"| {row.name} | not yet available | | | | | | | | | | |"
        return Measured(line, None, None, None, None)
    pool = pools.get(row.world)
    if pool is None:
        pool = pools[row.world] = WorkerPool(row.world, comm_timeout_s=120.0)
    pool.start()
    # the machine is shared: start when it is quiet (if it gets quiet), and measure the
    # rates of exactly this many concurrent ranks just before and after the steps, on
    # both clocks
    wait_quiet(QUIET, max_wait_s)
    load0 = load_average()
    _, before = profile_here(pool, hw, quick)
    res = pool.run(BODY, row.config(), steps, warmup, timeout_s=600.0)
    after = pool.run(COMPUTE_BODY, quick, timeout_s=600.0)
    tp_after = pool.run(TP_GRID_BODY, quick, timeout_s=600.0)
    load1 = load_average()
    # the tensor-parallel blocks (pairs) measured before and after the steps, the mean per
    # point, as the compute rates are pooled over both
    before = [
        {**b, "tp_grid": mean_grids([b["tp_grid"], a])} if "tp_grid" in b else b
        for b, a in zip(before, tp_after, strict=True)
    ]
    # the fresh compute rates with each rank's own collectives, ring, pipeline and
    # tensor-parallel blocks
    pooled = [*before, *({**before[i], "compute": c} for i, c in enumerate(after))]
    prof = {
        c: profile_from_results(pooled, hw.memory_bytes, hw.name, clock=c)[0]
        for c in ("wall", "cpu")
    }
    e = predict(row, prof["wall"])
    e_cpu = predict(row, prof["cpu"])
    # a rank idle in its pipeline bubble sleeps in the transport's receive: process CPU
    # time does not advance, so the CPU-time prediction leaves the bubble out
    cpu_pred = e_cpu.time.total - e_cpu.time.bubble
    # the same profile without the block composition ratio, for comparison
    e_plain = predict(
        row, replace(prof["cpu"], block_scale=(), tp_block_scale=(), sp_block_scale=())
    )
    plain_pred = e_plain.time.total - e_plain.time.bubble
    r0 = next(r for r in res if r["rank"] == 0)
    state_meas = r0["params"] + r0["grads"] + r0["master"] + r0["optimizer"]
    step_meas = statistics.median(max(ts) for ts in zip(*(r["times"] for r in res), strict=True))
    cpu_meas = statistics.median(max(ts) for ts in zip(*(r["cpu_times"] for r in res), strict=True))
    # rank 0: pipeline stage 0, shard 0
    mem = stage_memory(e.query, e.layout, 0)
    # activations of one micro-batch on that stage (the in-flight factor apart)
    act_pred = (mem.activations + mem.embedding_head) / mem.in_flight
    k = korthikanti_bytes(row, e)
    meas_act = r0["activations"]
    sp0 = stage_params(e.model, e.layout, 0)
    bucket_pred = (
        sp0.params * e.precision.grad_bytes
        if copies_gradients(e.layout, e.precision, e.runtime)
        else 0
    )
    buckets = "n/a" if r0["buckets"] is None else _mb(r0["buckets"])
    line = (
        f"| {row.name} | {_mb(mem.state)} / {_mb(state_meas)} | "
        f"{_err(mem.state, state_meas)} | {_mb(bucket_pred)} / {buckets} | "
        f"{_mb(meas_act)} | {_mb(act_pred)} ({_err(act_pred, meas_act)}) | "
        f"{_mb(k)} ({_err(k, meas_act)}) | "
        f"{1e3 * cpu_pred:.1f} / {1e3 * cpu_meas:.1f} | "
        f"{_err(cpu_pred, cpu_meas)} | "
        f"{1e3 * e.time.total:.1f} / {1e3 * step_meas:.1f} | "
        f"{_err(e.time.total, step_meas)} | {load0:.0f} -> {load1:.0f} |"
    )
    t = e_cpu.time
    ms = lambda v: f"{1e3 * v:.1f}"  # noqa: E731
    part = (
        f"| {row.name} | {ms(t.compute + t.recompute)} | {ms(t.tp_comm)} | "
        f"{ms(t.cp_comm)} | {ms(t.pp_comm)} + {ms(t.bubble)} | "
        f"{ms(t.dp_comm)} ({ms(t.dp_comm_total)}) | "
        f"{ms(t.optimizer)} | {ms(t.other)} | {ms(cpu_pred)} | {ms(cpu_meas)} | "
        f"{_block_ratio(e_cpu):.3f} | {ms(plain_pred)} ({_err(plain_pred, cpu_meas)}) |"
    )
    return Measured(
        line,
        part,
        (cpu_pred - cpu_meas) / cpu_meas,
        (e.time.total - step_meas) / step_meas,
        (plain_pred - cpu_meas) / cpu_meas,
    )


def measured_table(
    hw: Any, rows: list[Row], steps: int, warmup: int, max_wait_s: float, quick: bool,
    pools: dict[int, Any],
) -> tuple[list[str], list[Measured]]:  # fmt: skip
    """Run every row of ``rows`` on ``pools`` and format the comparison: the table's
    lines and each row's result."""
    results = [measure_row(r, hw, pools, steps, warmup, max_wait_s, quick) for r in rows]
    parts = [m.part for m in results if m.part is not None]
    lines = [*TABLE_HEAD, *(m.line for m in results), "", PARTS_NOTE, "", *PARTS_HEAD, *parts]
    return lines, results


def shapes_table(
    hw: Any, shapes: list[Shape], only: str, steps: int, warmup: int, max_wait_s: float,
    quick: bool,
) -> list[str]:  # fmt: skip
    """Every layout on every shape of ``shapes``: the step-time error distribution per
    layout on both clocks, every cell, then each shape's full comparison."""
    from plait.bench.error_summary import Cell, cells_table, summary_table

    cpu: list[Cell] = []
    wall: list[Cell] = []
    plain: list[Cell] = []
    detail: list[str] = []
    pools: dict[int, Any] = {}
    try:
        for shape in shapes:
            rows = [r for r in rows_at(shape) if not only or only in r.name]
            lines, results = measured_table(hw, rows, steps, warmup, max_wait_s, quick, pools)
            for row, m in zip(rows, results, strict=True):
                if m.cpu_err is not None and m.wall_err is not None and m.plain_err is not None:
                    cpu.append(Cell(row.name, shape.name, m.cpu_err))
                    wall.append(Cell(row.name, shape.name, m.wall_err))
                    plain.append(Cell(row.name, shape.name, m.plain_err))
            detail += [f"#### {shape.name} ({shape.tokens} tokens per micro-batch)", "", *lines, ""]
    finally:
        for pool in pools.values():
            pool.close()
    if not cpu:
        return ["No layout ran.", "", *detail]
    return [
        *summary_table(cpu, "CPU"),
        "",
        *summary_table(wall, "wall"),
        "",
        "The same CPU-time prediction without the block grids (`block_scale`, "
        "`tp_block_scale`, `sp_block_scale`: block ratio 1), to tell whether they earn "
        "their place off the grid:",
        "",
        *summary_table(plain, "CPU no-grid"),
        "",
        "CPU time error of every cell (shape: hidden h, head dimension d, layers L, "
        "sequence s, micro-batch b):",
        "",
        *cells_table(cpu),
        "",
        *detail,
    ]


# --------------------------------------------------------------------------- main


def _profile_line(hw: Any) -> str:
    ar = hw.intra.fit("all_reduce")
    return (
        f"`{hw.name}`: matmul up to {hw.matmul.peak / 1e9:.1f} GFLOP/s, attention up to "
        f"{hw.attention.peak / 1e9:.1f} GFLOP/s, element-wise up to "
        f"{hw.elementwise.peak / 1e9:.1f} GB/s, {hw.op_overhead_s * 1e6:.1f} us per operator, "
        f"all-reduce alpha {ar[0] * 1e6:.0f} us, B {ar[1] / 1e9:.2f} GB/s"
    )


def main(argv: list[str] | None = None) -> int:
    from plait.bench.calibrate import calibrate
    from plait.bench.results import write_section
    from plait.plan.profile_toml import load_hardware

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", help="use this hardware profile instead of calibrating")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per layout")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    ap.add_argument("--out", help="rewrite this script's section of this markdown file")
    ap.add_argument("--only", default="", help="measure only rows whose name contains this")
    ap.add_argument("--no-published", action="store_true", help="skip part 2")
    ap.add_argument(
        "--max-wait", type=float, default=60.0, help="seconds to wait for a quiet machine"
    )
    ap.add_argument(
        "--shapes", type=int, default=0,
        help="measure every layout on this many shapes drawn off the calibration points "
        "(plait.bench.random_shapes) instead of the fixed model; no part 2",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="the seed of --shapes")
    ap.add_argument(
        "--tiny", action="store_true",
        help="smallest run (the test suite's): 1 step, quick calibrations, the --only row "
        "(default tp2 + SP)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.shapes < 0:
        ap.error(f"--shapes must not be negative, got {args.shapes}")
    if args.tiny:  # one 2-rank row, quick calibrations, no wait for a quiet machine
        args.steps, args.warmup, args.max_wait = 1, 0, 0.0
        args.only = args.only or "tp2 + SP"
    shapes = draw_shapes(args.shapes, args.seed) if args.shapes else []

    t0 = time.time()
    if args.profile:
        hw = load_hardware(args.profile)
    else:
        hw, _ = calibrate(2, quick=args.tiny)
    if shapes:
        measured = shapes_table(
            hw, shapes, args.only, args.steps, args.warmup, args.max_wait, args.tiny
        )
    else:
        rows = [r for r in ROWS if not args.only or args.only in r.name]
        measured, _ = measured_table(
            hw, rows, args.steps, args.warmup, args.max_wait, args.tiny, {}
        )
    published = [] if args.no_published or shapes else published_table()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python benchmarks/planner_vs_measured.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    what = (
        f"{len(shapes)} shape{'s' if len(shapes) > 1 else ''} drawn with seed {args.seed} "
        "(`plait.bench.random_shapes`)"
        if shapes
        else f"Model `{MODEL}` (0.87 M parameters), sequence {SEQ}"
    )
    text = [
        f"## Planner vs measured (issue {46 if shapes else 6})",
        "",
        f"Written by `{cmd.strip()}` on {stamp} "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch fp32, "
        f"gloo ranks of one thread; {args.steps} measured steps per layout after "
        f"{args.warmup}; {time.time() - t0:.0f} s). {what}, AdamW, plait's Trainer.",
        "",
        "### Measured on this machine" + (", off the calibration points" if shapes else ""),
        "",
        *measured,
    ]
    if published:
        text += ["", "### Published large-scale runs", "", *published]
    text += [
        "",
        f"Reference profile (`--profile`, used for memory and names): {_profile_line(hw)}.",
    ]
    out = "\n".join(text)
    print(out)
    if args.out:
        section = "planner_vs_measured_shapes" if shapes else "planner_vs_measured"
        write_section(Path(args.out), section, out.rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
