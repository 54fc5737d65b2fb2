"""Where a pipeline step's time goes: plait's runtime on p gloo ranks, one schedule.

For each schedule the runtime's own records (every action's start and end) of
``--steps`` steps after ``--warmup`` are split, per rank, into

* **compute** -- the F / B / I / W actions;
* **comm post** -- inside :func:`plait.comm.batch_isend_irecv` (building the P2P ops and
  handing them to gloo);
* **comm wait** -- the rest of a communication batch: waiting for the receives;
* **gaps** -- between actions (the runtime's own bookkeeping, Python);
* **end** -- after the last action (waiting for the sends).

The **replay** runs the schedule's dependencies with each action's *measured* duration
and free communication: the makespan that the compute alone explains. Each compute
action's CPU time on the computing thread (``time.thread_time``: what the action costs,
whatever else the machine runs) and its minor page faults are recorded too, so two
schedules' F, B, I and W can be compared on a loaded machine. ``measured -
replay`` is what the messages, their waits and the runtime's bookkeeping add. With
``--cprofile`` rank 0's hottest functions (by own time) over the measured steps are
printed too.

Run from the repository root::

    python benchmarks/pipeline_profile.py --schedules 1f1b,interleaved,zb --stages 2 -m 8

A schedule name with ``:late`` (``1f1b:late``) runs with ``early_recv=False``. The
schedules' steps alternate (one step of each in turn), so they meet the same load.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

BODY = "benchmarks.pipeline_profile:profile_body"


def profile_body(
    ctx: Any,
    model_kwargs: dict[str, Any],
    schedules: list[tuple[str, int]],
    m: int,
    micro: int,
    seq: int,
    warmup: int,
    steps: int,
    cprofile: bool,
) -> dict[str, Any]:
    """On every rank: per schedule, ``steps`` timed steps' records, post times and wall."""
    import cProfile
    import io
    import pstats

    from plait import comm
    from plait.config import ModelConfig
    from plait.model import Transformer, lm_loss
    from plait.parallel.pipeline.runtime import PipelineRuntime
    from plait.parallel.pipeline.schedules import build_schedule
    from plait.parallel.pipeline.split import split_transformer

    posts: list[float] = []
    real = comm.batch_isend_irecv

    def timed_batch(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        out = real(*a, **k)
        posts.append(time.perf_counter() - t0)
        return out

    comm.batch_isend_irecv = timed_batch
    cpu_ops: list[tuple[str, float]] = []  # (op, thread CPU s) per compute action
    flt_ops: list[tuple[str, int]] = []  # (op, minor page faults of the thread)
    mcfg = ModelConfig(**model_kwargs)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, mcfg.vocab_size, (m * micro, seq), generator=g)  # (batch, seq)
    y = torch.randint(0, mcfg.vocab_size, (m * micro, seq), generator=g)
    out: dict[str, Any] = {}
    try:
        rts: dict[str, tuple[Any, Any, Any, list[dict[str, Any]]]] = {}
        for label, v in schedules:
            name, _, late = label.partition(":")
            mesh = ctx.mesh(dp=1, pp=ctx.world_size)
            stages = split_transformer(Transformer(mcfg, seed=0), mesh, chunks=v)
            rt = PipelineRuntime(
                stages,
                build_schedule(name, ctx.world_size, m, v),
                mesh.axis("pp"),
                lm_loss,
                (micro, seq, mcfg.dim),
                torch.float32,
                early_recv=late != "late",
            )
            prof = cProfile.Profile() if cprofile and ctx.rank == 0 else None
            vars(rt)["_compute"] = _thread_timed(rt._compute, cpu_ops, flt_ops)  # per instance
            rts[label] = (rt, stages, prof, [])
        for i in range(warmup + steps):
            order = list(rts) if i % 2 == 0 else list(reversed(rts))
            for label in order:
                rt, stages, prof, runs = rts[label]
                comm.barrier(ctx.mesh(dp=1, pp=ctx.world_size).axis("pp"))
                posts.clear()
                cpu_ops.clear()
                flt_ops.clear()
                if prof is not None and i >= warmup:
                    prof.enable()
                c0, t0 = time.process_time(), time.perf_counter()
                rt.step(x, y)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                if prof is not None and i >= warmup:
                    prof.disable()
                stages.zero_grad(set_to_none=True)
                if i >= warmup:
                    recs = [(r.action, rt.step_start + r.start, rt.step_start + r.end)
                            for r in rt.records]
                    runs.append({"wall": wall, "cpu": cpu, "t0": t0, "recs": recs,
                                 "posts": list(posts), "thread_cpu": list(cpu_ops),
                                 "faults": list(flt_ops)})
        for label, (_rt, _stages, prof, runs) in rts.items():
            text = ""
            if prof is not None:
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
                text = buf.getvalue()
            out[label] = {"runs": runs, "cprofile": text}
    finally:
        comm.batch_isend_irecv = real
    return out


def _thread_timed(compute: Any, into: list[tuple[str, float]], faults: list[tuple[str, int]]
                  ) -> Any:
    """``compute`` recording each action's op and its thread CPU time into ``into``
    (CPU time of the computing thread only: what the action costs, whatever the load)."""

    def timed(a: Any) -> None:
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        c0 = time.thread_time()
        compute(a)
        c1 = time.thread_time()
        faults.append((a.op.value, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0))
        into.append((a.op.value, c1 - c0))

    return timed


def _replay(schedule: Any, durations: list[dict[Any, float]]) -> float:
    """Makespan of ``schedule`` with each compute action's measured duration and free,
    never-blocking sends (a receive waits for its send's posting): the simulator's replay."""
    from plait.parallel.pipeline.simulate import simulate

    return float(simulate(schedule, durations=durations).makespan)


def analyse(res: list[dict[str, Any]], name: str, p: int, m: int, v: int) -> str:
    from plait.parallel.pipeline.schedules import build_schedule

    sched = build_schedule(name.partition(":")[0], p, m, v)
    n = len(res[0][name]["runs"])
    rows = []
    for k in range(n):
        runs = [res[r][name]["runs"][k] for r in range(p)]
        t0 = min(run["t0"] for run in runs)
        t_end = max(max(e for _, _, e in run["recs"]) for run in runs)
        makespan = max(run["t0"] + run["wall"] for run in runs) - t0
        per = []
        durations: list[dict[Any, float]] = []
        for run in runs:
            comp = sum(e - s for a, s, e in run["recs"] if a.op.is_compute)
            seen: set[tuple[float, float]] = set()
            comm_total = 0.0
            for a, s, e in run["recs"]:
                if a.op.is_comm and (s, e) not in seen:
                    seen.add((s, e))
                    comm_total += e - s
            post = sum(run["posts"])
            first = min(s for _, s, _ in run["recs"])
            last = max(e for _, _, e in run["recs"])
            gaps = (last - first) - comp - comm_total
            per.append((comp, post, comm_total - post, gaps, run["t0"] + run["wall"] - last,
                        len(seen)))
            durations.append({a: e - s for a, s, e in run["recs"] if a.op.is_compute})
        replay = _replay(sched, durations)
        rows.append((makespan, t_end - t0, replay, per, [run["cpu"] for run in runs]))
    rows.sort(key=lambda r: r[0])
    med = rows[len(rows) // 2]
    lines = [f"### {name} (v={v}), p={p}, m={m}: median of {n} steps"]
    lines.append(
        f"step {med[0] * 1e3:.1f} ms; replay of the measured compute with free messages "
        f"{med[2] * 1e3:.1f} ms; excess {(med[0] - med[2]) * 1e3:.1f} ms "
        f"({(med[0] - med[2]) / med[0] * 100:.0f} %)"
    )
    lines.append("| rank | compute ms | comm post ms | comm wait ms | gaps ms | end ms | batches |")
    lines.append("|---:|---:|---:|---:|---:|---:|---:|")
    for r, (comp, post, wait, gaps, end, nb) in enumerate(med[3]):
        lines.append(
            f"| {r} | {comp * 1e3:.1f} | {post * 1e3:.2f} | {wait * 1e3:.1f} | "
            f"{gaps * 1e3:.2f} | {end * 1e3:.2f} | {nb} |"
        )
    ops: dict[str, list[float]] = {}
    for k in range(n):
        for r in range(p):
            for a, s, e in res[r][name]["runs"][k]["recs"]:
                if a.op.is_compute:
                    ops.setdefault(f"{a.op.value}@rank{r}", []).append(e - s)
    lines.append("median action ms: " + ", ".join(
        f"{k} {statistics.median(v) * 1e3:.1f}" for k, v in sorted(ops.items())))
    cpu: dict[str, list[float]] = {}
    for k in range(n):
        for r in range(p):
            for op, c in res[r][name]["runs"][k]["thread_cpu"]:
                cpu.setdefault(f"{op}@rank{r}", []).append(c)
    lines.append("median action thread CPU ms: " + ", ".join(
        f"{k} {statistics.median(v) * 1e3:.2f}" for k, v in sorted(cpu.items())))
    flt: dict[str, list[float]] = {}
    for k in range(n):
        for r in range(p):
            for op, c in res[r][name]["runs"][k]["faults"]:
                flt.setdefault(f"{op}@rank{r}", []).append(c)
    lines.append("median action minor page faults: " + ", ".join(
        f"{k} {statistics.median(v):.0f}" for k, v in sorted(flt.items())))
    per_step = [[sum(c for _, c in res[q][name]["runs"][k]["thread_cpu"]) for k in range(n)]
                for q in range(p)]
    lines.append("action thread CPU ms per step per rank (median): " + ", ".join(
        f"{statistics.median(s) * 1e3:.1f}" for s in per_step))
    lines.append("CPU s per step per rank (median): " + ", ".join(
        f"{statistics.median(r[4][q] for r in rows) * 1e3:.0f} ms" for q in range(p)))
    ex = [r[0] - r[2] for r in rows]
    lines.append(f"excess over replay, all steps (ms): {', '.join(f'{e * 1e3:.1f}' for e in ex)}; "
                 f"median {statistics.median(ex) * 1e3:.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedules", default="1f1b,interleaved,zb")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("-m", "--microbatches", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.stages, args.microbatches, args.warmup, args.steps = 2, 4, 0, 1
        args.dim, args.layers, args.heads, args.vocab, args.micro, args.seq = 32, 4, 2, 64, 1, 16

    from plait.testing.pool import WorkerPool

    model_kwargs = {
        "vocab_size": args.vocab, "dim": args.dim, "n_layers": args.layers,
        "n_heads": args.heads, "max_seq_len": args.seq,
    }
    scheds = [(s, 2 if s.startswith("interleaved") else 1) for s in args.schedules.split(",")]
    with WorkerPool(args.stages, comm_timeout_s=600) as pool:
        res = pool.run(BODY, model_kwargs, scheds, args.microbatches, args.micro, args.seq,
                       args.warmup, args.steps, args.cprofile, timeout_s=1200)
    for name, v in scheds:
        print(analyse(res, name, args.stages, args.microbatches, v))
        if args.cprofile:
            print(res[0][name]["cprofile"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
