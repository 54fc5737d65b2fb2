"""ZeRO-1/2/3 under pipeline parallelism on CPU: step time, dp traffic and memory per choice.

Four gloo ranks (pp2 x dp2, one torch thread each) train the built-in transformer with
the interleaved schedule (2 chunks per rank, m micro-batches) under each variant:

* ``zero1`` -- the baseline (ZeRO-1: gradients accumulated in full buffers, one
  reduce-scatter per step through the zero-valued backward, optimizer state sharded);
* ``zero2 step`` / ``zero2 micro`` -- ``parallel.pp_grad_reduce`` = step / microbatch;
* ``zero3 keep`` / ``zero3 reshard`` -- ``parallel.pp_reshard`` false / true
  (gradients reduced once per step).

All variants are built in the same processes and stepped in alternation (one step of
each per round, after one warm-up step each, an untimed barrier before every step), so
the machine's load hits them alike. A step's time is the slowest rank's; the table has
the median over rounds, the CPU time of that rank (``time.process_time``) and both as a
ratio to ``zero1`` in the same round (median of the paired ratios). Also per rank and
step: dp bus bytes (plait's comm counters), the peak unsharded gradient bytes held by
the pipeline driver and ZeRO-3's peak gathered parameter bytes (measured), and the
persistent state bytes (:func:`plait.train.memory.memory_report`: parameters,
gradients, masters, optimizer state; the largest rank).

Run from the repository root::

    python benchmarks/zero_pipeline.py                          # print the table
    python benchmarks/zero_pipeline.py --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the pool's workers resolve the body by module name
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from plait.bench.results import command_line, environment, load_average, write_section  # noqa: E402

BODY = "benchmarks.zero_pipeline:bench_body"
VARIANTS: dict[str, dict[str, Any]] = {
    "zero1": {"zero": 1},
    "zero2 step": {"zero": 2, "pp_grad_reduce": "step"},
    "zero2 micro": {"zero": 2, "pp_grad_reduce": "microbatch"},
    "zero3 keep": {"zero": 3},
    "zero3 reshard": {"zero": 3, "pp_reshard": True},
}


def bench_body(
    ctx: Any, model_kw: dict[str, Any], m: int, micro: int, seq: int, rounds: int
) -> dict[str, Any]:
    from plait import comm
    from plait.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from plait.model import Transformer
    from plait.optim import Optimizer
    from plait.parallel.parallelize import parallelize
    from plait.train.memory import memory_report

    torch.set_num_threads(1)
    mesh = ctx.mesh(dp=2, pp=2)
    world = mesh.axis("dp", "pp")
    g = torch.Generator().manual_seed(mesh.index("dp"))
    model_cfg = ModelConfig(**model_kw)
    x = torch.randint(0, model_cfg.vocab_size, (m * micro, seq), generator=g)  # (batch, seq)
    runs = {}
    for name, kw in VARIANTS.items():
        par = ParallelConfig(
            dp=2, pp=2, pipeline_schedule="interleaved", chunks=2, microbatches=m, **kw
        )
        cfg = Config(
            model=model_cfg,
            parallel=par,
            train=TrainConfig(global_batch=2 * m * micro, seq_len=seq),
        )
        model = Transformer(model_cfg, seed=0)
        pm = parallelize(model, mesh, cfg)
        opt = Optimizer(pm, torch.optim.AdamW(model.parameters(), lr=1e-4))
        runs[name] = (pm, opt)

    def step(name: str) -> tuple[float, float, float]:
        pm, opt = runs[name]
        comm.barrier(world)
        b0 = mesh.stats.total_bytes("dp")
        t0, c0 = time.perf_counter(), time.process_time()
        pm.step(x, x)
        opt.step()
        opt.zero_grad()
        return (
            time.perf_counter() - t0,
            time.process_time() - c0,
            mesh.stats.total_bytes("dp") - b0,
        )

    for name in runs:
        step(name)  # warm-up
    times: dict[str, list[tuple[float, float, float]]] = {n: [] for n in runs}
    for _ in range(rounds):
        for name in runs:
            times[name].append(step(name))
    out: dict[str, Any] = {"times": times, "rank": mesh.rank}
    for name, (pm, opt) in runs.items():
        b = memory_report(pm, opt, mesh.rank).bytes
        driver = pm.pipeline.zero if pm.pipeline is not None else None
        out[name] = {
            "state": b["params"] + b["grads"] + b["master"] + b["optimizer"],
            "peak_grads": driver.peak_grad_bytes if driver is not None else b["grads"],
            "peak_gathered": pm.zero.peak_gathered_bytes if pm.zero is not None else 0,
        }
    return out


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--m", type=int, default=8, help="micro-batches per step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.dim, args.layers, args.seq, args.micro, args.m, args.rounds = 32, 4, 16, 1, 4, 1
    from plait.testing import WorkerPool

    model_kw = {
        "vocab_size": 256,
        "dim": args.dim,
        "n_layers": args.layers,
        "n_heads": 4,
        "max_seq_len": args.seq,
    }
    load0 = load_average()
    with WorkerPool(4) as pool:
        res = pool.run(BODY, model_kw, args.m, args.micro, args.seq, args.rounds)
    load1 = load_average()
    rows = ["| variant | step s (median) | CPU s | wall / zero1 | CPU / zero1 | dp MB/step | "
            "peak grads MB | peak gathered MB | state MB |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def slowest(name: str, k: int) -> tuple[float, float, float]:
        """Round ``k`` of ``name`` on the rank whose step took longest."""
        t: tuple[float, float, float] = max((r["times"][name][k] for r in res), key=lambda v: v[0])
        return t

    for name in VARIANTS:
        walls, cpus, wr, cr = [], [], [], []
        for k in range(args.rounds):
            (w, c, _), (w0, c0, _) = slowest(name, k), slowest("zero1", k)
            walls.append(w)
            cpus.append(c)
            wr.append(w / w0)
            cr.append(c / c0)
        dp_bytes = max(statistics.median(t[2] for t in r["times"][name]) for r in res)
        rows.append(
            f"| {name} | {statistics.median(walls):.3f} | {statistics.median(cpus):.3f} | "
            f"{statistics.median(wr):.2f} | {statistics.median(cr):.2f} | {_mb(dp_bytes)} | "
            f"{_mb(max(r[name]['peak_grads'] for r in res))} | "
            f"{_mb(max(r[name]['peak_gathered'] for r in res))} | "
            f"{_mb(max(r[name]['state'] for r in res))} |"
        )
    notes = [
        f"{environment()}; {os.cpu_count()} cores, gloo, 4 ranks x 1 thread; load average "
        f"{load0:.1f} before, {load1:.1f} after.",
        f"Model: dim {args.dim}, {args.layers} layers, 4 heads, vocab 256, fp32; pp2 x dp2, "
        f"interleaved (2 chunks per rank), {args.m} micro-batches of {args.micro} x "
        f"{args.seq} tokens per dp rank; {args.rounds} alternating rounds.",
        f"Command: `{command_line(__file__)}`",
    ]
    table = "\n".join(rows)
    print(table)
    print("\n".join(notes))
    if args.out is not None:
        section = "## ZeRO-1/2/3 under pipeline parallelism (issue 19)\n\n" + table + "\n\n"
        write_section(args.out, "zero_pipeline", section + "\n".join(notes))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
