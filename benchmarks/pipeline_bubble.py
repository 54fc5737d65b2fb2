"""Pipeline bubble on CPU: measured (from the runtime's timeline) against the simulator.

For p = 2 and 4 pipeline ranks (a :class:`plait.testing.WorkerPool` of p gloo ranks,
one torch thread each) and m = 4, 8, 16 micro-batches, each schedule (GPipe, 1F1B,
interleaved 1F1B with 2 chunks per rank, zero-bubble ZB-H1) runs forward + backward of
one batch of the built-in transformer (no optimizer step) for ``--warmup`` + ``--steps``
steps; an untimed barrier precedes each step. A step's time is the slowest rank's; the
table shows the median and the fastest step. On a loaded machine a step's timeline is
dominated by which rank the operating system descheduled when, so the bubble is taken
from the *fastest* (least disturbed) step's recorded timeline:

* **measured bubble** -- ``1 - busy / (p x makespan)`` over the ranks' compute actions
  (:func:`plait.viz.bubble_fraction`); the ranks' records are aligned on
  ``time.perf_counter`` (one clock for the processes of one machine);
* **simulated bubble** -- :func:`plait.parallel.pipeline.simulate.simulate` of the same
  schedule with uniform costs equal to the step's *measured* mean F, B (I, W) action
  times and zero communication time, i.e. what the schedule alone explains;
* **formula** -- ``(p-1)/(m+p-1)`` (divided by v for interleaved; for ZB-H1 the
  simulator's unit-cost value).

The reference is ``torch.distributed.pipelining`` (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B`` with the same 2 stages per rank (stage k on rank k % p, its
"loop" placement, as plait's split), ``ScheduleInterleavedZeroBubble`` with one stage
per rank (ZB1P, i.e. ZB-H1, as plait's ``zb``); ``PipelineStage`` over the very same
pieces, same micro-batches, its own loss scaling) in the same processes. Every plait and
torch schedule of one m runs one step in turn, in a rotating order, so the paired
ratios (median over steps of plait / torch, wall and CPU time) compare steps taken
under the same load; a second table compares interleaved and zero-bubble with plait's
own 1F1B the same way, against the simulator's prediction. (``ScheduleZBVZeroBubble``
and ``ScheduleDualPipeV`` need the V stage placement, stages r and 2p - 1 - r on rank r,
which plait's schedules do not use, so they are left out.) With p = 4 on a 2-core
machine four single-threaded ranks share two cores.

Run from the repository root::

    python benchmarks/pipeline_bubble.py                         # print the table
    python benchmarks/pipeline_bubble.py --out benchmarks/RESULTS.md --pictures docs/pipeline
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the pool's workers resolve the body by module name
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from plait.bench.results import command_line, environment, write_section  # noqa: E402

BODY = "benchmarks.pipeline_bubble:bench_body"
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1))
TORCH = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb": "ScheduleInterleavedZeroBubble",  # ZB1P; with one stage per rank = ZB-H1
}


def _batch(m: int, micro: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (m * micro, seq), generator=g)  # (batch, seq)
    y = torch.randint(0, vocab, (m * micro, seq), generator=g)
    return x, y


Record = tuple[int, Any, float, float]


def _plait_step(
    ctx: Any, mcfg: Any, name: str, v: int, m: int, micro: int, seq: int
) -> Callable[[], list[Record]]:
    """One step of plait's runtime; returns the records on the shared perf_counter clock."""
    from plait.model import Transformer, lm_loss
    from plait.parallel.pipeline.runtime import PipelineRuntime
    from plait.parallel.pipeline.schedules import build_schedule
    from plait.parallel.pipeline.split import split_transformer

    mesh = ctx.mesh(dp=1, pp=ctx.world_size)
    stages = split_transformer(Transformer(mcfg, seed=0), mesh, chunks=v)
    rt = PipelineRuntime(
        stages,
        build_schedule(name, ctx.world_size, m, v),
        mesh.axis("pp"),
        lm_loss,
        (micro, seq, mcfg.dim),
        torch.float32,
    )
    x, y = _batch(m, micro, seq, mcfg.vocab_size, 1)

    def step() -> list[Record]:
        rt.step(x, y)
        stages.zero_grad(set_to_none=True)
        t0 = rt.step_start
        return [(r.rank, r.action, t0 + r.start, t0 + r.end) for r in rt.records]

    return step


def _torch_step(
    ctx: Any, mcfg: Any, name: str, v: int, m: int, micro: int, seq: int
) -> Callable[[], list[Record]]:
    """One step of torch.distributed.pipelining over the same pieces (piece k on rank
    k % p, as plait's round-robin split and torch's "loop" stage placement agree)."""
    import torch.distributed.pipelining as tpp

    from plait.model import Transformer, lm_loss
    from plait.parallel.pipeline.split import split_transformer

    mesh = ctx.mesh(dp=1, pp=ctx.world_size)
    stages = split_transformer(Transformer(mcfg, seed=0), mesh, chunks=v)
    p, r = ctx.world_size, ctx.rank
    pieces = [stages.piece(s) for s in range(r, p * v, p)]
    tstages = [
        tpp.PipelineStage(piece, s, p * v, torch.device("cpu"))
        for piece, s in zip(pieces, range(r, p * v, p), strict=True)
    ]
    cls = getattr(tpp, TORCH[name])
    multi = name in ("interleaved", "zb")  # the multi-stage classes take a list
    sched = cls(tstages if multi else tstages[0], n_microbatches=m, loss_fn=lm_loss)
    x, y = _batch(m, micro, seq, mcfg.vocab_size, 1)
    first, last = (
        0 in [t.stage_index for t in tstages],
        p * v - 1 in [t.stage_index for t in tstages],
    )

    def step() -> list[Record]:
        kw: dict[str, Any] = {"target": y, "losses": []} if last else {}
        if first:
            sched.step(x, **kw)
        else:
            sched.step(**kw)
        stages.zero_grad(set_to_none=True)
        return []

    return step


def _timed(ctx: Any, step: Callable[[], list[Record]]) -> tuple[float, float, list[Record]]:
    """Barrier (untimed), then one step: (wall seconds, CPU seconds of this process (all
    its threads, gloo's included), records)."""
    from plait import comm

    comm.barrier(ctx.mesh(dp=1, pp=ctx.world_size).axis("pp"))
    c0, t0 = time.process_time(), time.perf_counter()
    recs = step()
    return time.perf_counter() - t0, time.process_time() - c0, recs


def bench_body(
    ctx: Any,
    model_kwargs: dict[str, Any],
    ms: list[int],
    micro: int,
    seq: int,
    warmup: int,
    steps: int,
) -> dict[str, Any]:
    """On every rank, for each m: plait (each schedule) and torch (each schedule of the
    same name) -- all of them in one loop, step by step in a rotating order, so that
    every ratio (plait/torch, interleaved/1F1B, ...) pairs steps taken under the same
    load."""
    from plait.config import ModelConfig

    mcfg = ModelConfig(**model_kwargs)
    out: dict[str, Any] = {}
    for m in ms:
        runners: dict[str, Callable[[], list[Record]]] = {}
        for name, v in SCHEDULES:
            runners[f"plait/{name}/{m}"] = _plait_step(ctx, mcfg, name, v, m, micro, seq)
            if name in TORCH:
                runners[f"torch/{name}/{m}"] = _torch_step(ctx, mcfg, name, v, m, micro, seq)
        keys = list(runners)
        res: dict[str, tuple[list[float], list[list[Record]], list[float]]] = {
            k: ([], [], []) for k in keys
        }
        for i in range(warmup + steps):
            shift = i % len(keys)
            order = keys[shift:] + keys[:shift]
            if i % 2:
                order.reverse()
            for k in order:
                secs, cpu, recs = _timed(ctx, runners[k])
                if i >= warmup:
                    res[k][0].append(secs)
                    res[k][1].append(recs)
                    res[k][2].append(cpu)
        out.update(res)
        runners.clear()
    return out


def _steps(per_rank: list[list[float]]) -> tuple[int, float, float]:
    """(index of the fastest step, its time, the median time); a step's time is the
    slowest rank's."""
    slow = [max(ts) for ts in zip(*per_rank, strict=True)]
    k = min(range(len(slow)), key=slow.__getitem__)
    return k, slow[k], statistics.median(slow)


def _paired(mine: list[list[float]], ref: list[list[float]]) -> float:
    """Median over the paired steps of (plait / torch), a step's value being the slowest
    rank's (wall or CPU time)."""
    a = [max(ts) for ts in zip(*mine, strict=True)]
    b = [max(ts) for ts in zip(*ref, strict=True)]
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _analyse(
    results: list[dict[str, Any]], p: int, ms: list[int], load: str = ""
) -> list[dict[str, Any]]:
    from fractions import Fraction

    from plait.parallel.pipeline.actions import Op
    from plait.parallel.pipeline.schedules import build_schedule
    from plait.parallel.pipeline.simulate import Costs, simulate
    from plait.viz import bubble_fraction

    rows = []
    for m in ms:
        for name, v in SCHEDULES:
            key = f"plait/{name}/{m}"
            k, step, med = _steps([r[key][0] for r in results])
            recs = [rec for r in results for rec in r[key][1][k]]
            t0 = min(s for _, _, s, _ in recs)
            recs = [(rank, a, s - t0, e - t0) for rank, a, s, e in recs]
            mean = {
                op: statistics.mean(e - s for _, a, s, e in recs if a.op == op) or 0.0
                for op in {a.op for _, a, _, _ in recs if a.op.is_compute}
            }
            costs = Costs(
                forward=Fraction(mean[Op.FORWARD]),
                backward=Fraction(mean.get(Op.BACKWARD, 0.0)),
                backward_input=Fraction(mean.get(Op.BACKWARD_INPUT, 0.0)),
                backward_weight=Fraction(mean.get(Op.BACKWARD_WEIGHT, 0.0)),
                per_chunk=False,
            )
            sched = build_schedule(name, p, m, v)
            simres = simulate(sched, costs)
            sim = float(simres.bubble)
            formula = float(simulate(sched).bubble) if name == "zb" else (p - 1) / (m + p - 1) / v
            tkey = f"torch/{name}/{m}"
            ref = _steps([r[tkey][0] for r in results]) if name in TORCH else None
            paired = cpu_ratio = None
            if name in TORCH:
                paired = _paired([r[key][0] for r in results], [r[tkey][0] for r in results])
                cpu_ratio = _paired([r[key][2] for r in results], [r[tkey][2] for r in results])
            base = f"plait/1f1b/{m}"
            vs = _paired([r[key][0] for r in results], [r[base][0] for r in results])
            vs_cpu = _paired([r[key][2] for r in results], [r[base][2] for r in results])
            rows.append(
                {
                    "vs_1f1b": vs,
                    "vs_1f1b_cpu": vs_cpu,
                    "p": p,
                    "m": m,
                    "schedule": name if v == 1 else f"{name} (v={v})",
                    "step_ms": step * 1e3,
                    "median_ms": med * 1e3,
                    "measured": bubble_fraction(recs, p),
                    "simulated": sim,
                    "formula": formula,
                    "records": recs,
                    "name": name,
                    "torch_ms": ref[1] * 1e3 if ref else None,
                    "torch_median_ms": ref[2] * 1e3 if ref else None,
                    "f_ms": mean[Op.FORWARD] * 1e3,
                    "paired": paired,
                    "sim_ms": float(simres.makespan) * 1e3,
                    "unit_makespan": float(simulate(sched).makespan),
                    "cpu_ratio": cpu_ratio,
                    "load": load,
                }
            )
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| p | m | schedule | measured bubble | simulated (measured F/B) | formula | "
        "mean F ms | plait step ms fastest (median) | torch.pipelining ms fastest (median) "
        "| plait/torch paired wall | plait/torch paired CPU | load |\n"
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    )
    lines = []
    for r in rows:
        t, tm = r["torch_ms"], r["torch_median_ms"]
        ref = (
            f"{TORCH[r['name']]} {t:.0f} ({tm:.0f}) | {r['paired']:.2f} | {r['cpu_ratio']:.2f}"
            if t
            else "— | — | —"
        )
        lines.append(
            f"| {r['p']} | {r['m']} | {r['schedule']} | {r['measured']:.3f} | "
            f"{r['simulated']:.3f} | {r['formula']:.3f} | {r['f_ms']:.1f} | "
            f"{r['step_ms']:.0f} ({r['median_ms']:.0f}) | {ref} | {r['load']} |"
        )
    return head + "\n".join(lines) + "\n"


def _versus(rows: list[dict[str, Any]]) -> str:
    """Interleaved and zero-bubble against plait's own 1F1B at the same p, m: the
    simulator's predicted step ratio (unit costs F = 1, B = 2, I = W = 1; and the
    measured mean action times of each schedule's run) and the measured one (medians)."""
    head = (
        "| p | m | schedule | predicted / 1F1B (unit costs) | predicted / 1F1B (measured "
        "F, B, I, W) | measured / 1F1B (paired steps, median) | CPU time / 1F1B (paired) "
        "| target |\n"
        "|---:|---:|---|---:|---:|---:|---:|---|\n"
    )
    base = {(r["p"], r["m"]): r for r in rows if r["name"] == "1f1b"}
    lines = []
    for r in rows:
        b = base.get((r["p"], r["m"]))
        if r["name"] not in ("interleaved", "zb") or b is None:
            continue
        unit = r["unit_makespan"] / b["unit_makespan"]
        sim = r["sim_ms"] / b["sim_ms"]
        meas = r["vs_1f1b"]
        if unit < 0.95:
            verdict = "met" if meas < 1.0 else "**not met**"
        else:
            verdict = "— (predicted gain <= 5 %)"
        lines.append(
            f"| {r['p']} | {r['m']} | {r['schedule']} | {unit:.3f} | {sim:.3f} | "
            f"{meas:.3f} | {r['vs_1f1b_cpu']:.3f} | {verdict} |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default="2,4", help="pipeline sizes p (default 2,4)")
    ap.add_argument("--microbatches", default="4,8,16", help="m values (default 4,8,16)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--out", type=Path, default=None, help="rewrite this benchmark's section")
    ap.add_argument(
        "--pictures",
        type=Path,
        default=None,
        help="folder for one measured timeline per schedule (p = max, m = 8)",
    )
    ap.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.stages, args.microbatches, args.warmup, args.steps = "2", "4", 0, 1
        args.dim, args.layers, args.heads, args.vocab, args.micro, args.seq = 32, 4, 2, 64, 1, 16

    from plait.arch import param_count
    from plait.testing.pool import WorkerPool
    from plait.viz import draw_timeline

    model_kwargs = {
        "vocab_size": args.vocab,
        "dim": args.dim,
        "n_layers": args.layers,
        "n_heads": args.heads,
        "max_seq_len": args.seq,
    }
    from plait.config import ModelConfig

    n_params = param_count(ModelConfig(**model_kwargs))
    ms = [int(x) for x in args.microbatches.split(",")]
    rows: list[dict[str, Any]] = []
    for p in [int(x) for x in args.stages.split(",")]:
        load0 = os.getloadavg()[0]
        with WorkerPool(p, comm_timeout_s=args.timeout) as pool:
            res = pool.run(
                BODY,
                model_kwargs,
                ms,
                args.micro,
                args.seq,
                args.warmup,
                args.steps,
                timeout_s=args.timeout,
            )
        part = _analyse(res, p, ms, f"{load0:.1f} -> {os.getloadavg()[0]:.1f}")
        print(_table(part), flush=True)
        print(_versus(part), flush=True)
        rows += part
    if args.pictures is not None:
        p = max(r["p"] for r in rows)
        m = 8 if 8 in ms else ms[0]
        for r in rows:
            if r["p"] == p and r["m"] == m:
                out = args.pictures / f"measured_{r['name']}_p{p}_m{m}.png"
                draw_timeline(
                    r["records"], out, f"measured {r['schedule']}, p={p}, m={m}", ranks=p, unit="s"
                )
                print(f"wrote {out}")
    notes = [
        f"- {environment()}; {os.cpu_count()} cores; "
        "gloo on loopback. **Taken under load**: other engineers' tests and benchmarks "
        "shared the machine, and p = 4 puts four single-threaded ranks on two cores.",
        f"- Command: `{command_line(__file__)}`",
        f"- Model: built-in Transformer, dim {args.dim}, {args.layers} layers, {args.heads} "
        f"heads, vocab {args.vocab}, {n_params / 1e6:.2f} M parameters, cut into equal "
        f"block counts; micro-batch {args.micro} x seq {args.seq}, fp32; forward + backward "
        "only (no optimizer step) for both implementations.",
        f"- Timing: {args.warmup} warm-up + {args.steps} measured steps per cell, each after "
        "an untimed barrier; for each m every plait and torch schedule runs one step in "
        "turn (a rotating order), so every ratio pairs steps taken under the same load; a "
        "step's time (wall, or CPU: the process time of all a rank's threads) is the "
        "slowest rank's; paired ratios are medians over the steps of plait / torch (and "
        "schedule / plait 1F1B); the fastest step's timeline gives the measured bubble and "
        "the mean action times fed to the simulator. `load`: 1-minute load average before "
        "-> after the p's runs.",
    ]
    section = (
        "## Pipeline bubble (issues 5, 18)\n\n"
        + _table(rows)
        + "\nInterleaved and zero-bubble against plait's 1F1B (target: faster wherever the "
        "simulator predicts a gain of more than 5 %):\n\n" + _versus(rows) + "\n" + "\n".join(notes)
    )
    if args.out is not None:
        write_section(args.out, "pipeline_bubble", section)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
