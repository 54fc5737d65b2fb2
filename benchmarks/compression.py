"""Gradient compression on CPU gloo ranks: bytes, step time and loss, next to PyTorch
DDP's own communication hooks; and the planner's prediction on slow links.

Part 1 (measured). In one :class:`plait.testing.WorkerPool` of N ranks (N = 2, 4), the
built-in transformer (dim 64, 2 layers, byte vocabulary) trains ``--steps`` AdamW steps
on the built-in corpus (each rank its slice of the same global batches) under plait's
DataParallel with compression none / fp16 / bf16 / topk (rho 0.01) / powersgd (r 4), and under
torch DDP with no hook / ``fp16_compress_hook`` / ``bf16_compress_hook`` (refused on CPU
by DDP itself: it needs NCCL) / ``PowerSGDState`` + ``powerSGD_hook`` (rank 4, the same
warm-up of 2 steps). Per run: bytes per step (plait: its comm counters, bus bytes;
DDP: the hook's tensor sizes are not counted by plait, so only plait's column is filled),
the median step time over two rounds run in ABBA order, as a ratio to plait-none (the
same pool), and the
loss averaged over the last 10 steps. Each rank runs single-threaded.

Part 2 (planner). The predicted step time of a 1B-parameter llama-style model on 8 ranks
(dp 8, one rank per node, fp32), with and without compression, at 1, 10 and 100 Gbit/s.

Run from the repository root::

    python benchmarks/compression.py                        # print the tables
    python benchmarks/compression.py --out benchmarks/RESULTS.md --plot benchmarks/compression.png
"""

from __future__ import annotations

import argparse
import dataclasses
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

METHODS = ["none", "fp16", "bf16", "topk", "powersgd"]
DDP_HOOKS = ["ddp", "ddp-fp16", "ddp-bf16", "ddp-powersgd"]
SEQ, BATCH, LR = 64, 8, 3e-3


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from plait.config import DataConfig
    from plait.data import load_tokens

    tokens = torch.from_numpy(load_tokens(DataConfig(max_bytes=400_000)).astype("int64"))
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - SEQ - 1, (BATCH,), generator=g)
        x = torch.stack([tokens[s : s + SEQ] for s in starts])
        y = torch.stack([tokens[s + 1 : s + SEQ + 1] for s in starts])
        out.append((x, y))
    return out


def _model() -> torch.nn.Module:
    from plait.config import ModelConfig
    from plait.model import Transformer

    cfg = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
    return Transformer(cfg, seed=0)


def bench_body(ctx: Any, name: str, steps: int) -> dict[str, Any]:
    """One run on one rank: per-step losses, seconds and dp bytes."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from plait.config import ParallelConfig
    from plait.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    mesh = ctx.mesh(dp=ctx.world_size)
    n, r = mesh.size("dp"), mesh.index("dp")
    model = _model()
    if name.startswith("ddp"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel

        pg = mesh.axis("dp").pg
        ddp = DistributedDataParallel(model, process_group=pg, bucket_cap_mb=25)
        if name == "ddp-fp16":
            ddp.register_comm_hook(pg, default_hooks.fp16_compress_hook)
        elif name == "ddp-bf16":  # refused on CPU: "requires CUDA 11+ and NCCL 2.10+"
            ddp.register_comm_hook(pg, default_hooks.bf16_compress_hook)
        elif name == "ddp-powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=pg, matrix_approximation_rank=4, start_powerSGD_iter=2
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        run: torch.nn.Module = ddp
    else:
        cfg = ParallelConfig(
            compression=name,
            compression_ratio=0.01,
            compression_rank=4,  # type: ignore[arg-type]
            compression_start=2 if name == "powersgd" else 0,
        )
        run = parallelize(model, mesh, cfg)
    opt = torch.optim.AdamW(run.parameters(), lr=LR)
    per = BATCH // n
    losses, secs, nbytes = [], [], []
    for x, y in _batches(steps):
        xr, yr = x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]
        if dist.is_initialized():
            dist.barrier(group=mesh.axis("dp").pg)
        mesh.stats.reset()
        t0 = time.perf_counter()
        loss = F.cross_entropy(run(xr).reshape(-1, 256), yr.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        secs.append(time.perf_counter() - t0)
        nbytes.append(mesh.stats.total_bytes("dp"))
        losses.append(float(loss.detach()))
    return {"losses": losses, "secs": secs, "bytes": nbytes}


def measure(world: int, steps: int, timeout: float) -> dict[str, dict[str, Any]]:
    from plait.testing.pool import WorkerPool

    out: dict[str, dict[str, Any]] = {}
    names = METHODS + DDP_HOOKS
    with WorkerPool(world, comm_timeout_s=timeout) as pool:
        for order in (names, names[::-1]):  # two rounds, ABBA: drift hits every run alike
            for name in order:
                if "error" in out.get(name, {}):
                    continue
                try:
                    res = pool.run("benchmarks.compression:bench_body", name, steps)
                except Exception as e:  # a hook that fails on gloo is reported as such
                    last = [ln for ln in str(e).splitlines() if ln.strip()][-1]
                    out[name] = {"error": last.strip()[:100]}
                    continue
                step_s = [max(r["secs"][i] for r in res) for i in range(steps)]  # slowest
                mean_losses = [sum(r["losses"][i] for r in res) / world for i in range(steps)]
                o = out.setdefault(name, {"losses": mean_losses, "times": []})
                o["times"].extend(step_s[3:])
                o["bytes"] = statistics.median(res[0]["bytes"][3:])
    for o in out.values():
        if "times" in o:
            o["median_s"] = statistics.median(o["times"])
    return out


def _table(world: int, res: dict[str, dict[str, Any]]) -> str:
    base = res["none"]["median_s"]
    lines = [
        f"dp {world}:",
        "",
        "| run | dp bus bytes / step | step time vs plait none | loss (last 10 steps) |",
        "|---|---:|---:|---:|",
    ]
    for name in METHODS + DDP_HOOKS:
        r = res[name]
        label = f"plait {name}" if name in METHODS else name.replace("ddp", "torch DDP", 1)
        if "error" in r:
            lines.append(f"| {label} | — | {r['error']} | — |")
            continue
        b = f"{r['bytes'] / 2**20:.3f} MiB" if name in METHODS else "(not counted)"
        loss = statistics.fmean(r["losses"][-10:])
        lines.append(f"| {label} | {b} | {r['median_s'] / base:.2f} | {loss:.3f} |")
    return "\n".join(lines)


def planner_table() -> str:
    from plait.plan.estimate import step_time
    from plait.plan.hardware import Link, hardware_preset
    from plait.plan.layout import PRECISIONS, RUNTIMES, Layout
    from plait.plan.modelspec import ModelSpec
    from plait.plan.query import Query

    spec = ModelSpec.from_params(1e9, seq=2048)
    hw0 = hardware_preset("a100-80gb")
    lines = [
        "Planner: 1B llama-style model, dp 8 (one rank per node), fp32, a100-80gb compute, "
        "seq 2048, micro-batch 1; predicted step time (ms):",
        "",
        "| link | none | fp16 | bf16 | topk 0.01 | powersgd r4 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    cases = [(f"{g} Gbit/s", g) for g in (1, 10, 100)] + [("one node (NVLink)", 0)]
    for label, gbit in cases:
        link = Link(latency_s=20e-6, bandwidth=gbit * 1e9 / 8) if gbit else hw0.inter
        hw = dataclasses.replace(hw0, devices_per_node=1 if gbit else 8, inter=link)
        row = [label]
        for method in METHODS:
            lay = Layout(dp=8, compression=method, compression_ratio=0.01, compression_rank=4)
            q = Query.of_layout(spec, lay, hw, PRECISIONS["fp32"], RUNTIMES["plait"], 2048)
            t = step_time(q, lay)
            row.append(f"{t.total * 1e3:,.0f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--out", type=Path, help="write the section into this Markdown file")
    p.add_argument("--plot", type=Path, help="loss vs step and vs bytes, PNG")
    p.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    a = p.parse_args(argv)
    if a.tiny:  # 3 unmeasured steps + 1 measured
        a.worlds, a.steps = [2], 4
    load0 = load_average()
    parts, all_res = [], {}
    for world in a.worlds:
        res = measure(world, a.steps, a.timeout)
        all_res[world] = res
        parts.append(_table(world, res))
    parts.append(planner_table())
    text = "\n\n".join(
        [
            f"Measured by `{command_line('benchmarks/compression.py')}`, {a.steps} steps, "
            f"load average {load0:.1f} → {load_average():.1f}; {environment()}.",
            *parts,
        ]
    )
    print(text)
    if a.plot:
        _plot(all_res, a.plot)
    if a.out:
        write_section(a.out, "compression", "## Gradient compression\n\n" + text + "\n")
    return 0


def _plot(all_res: dict[int, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    world = max(all_res)
    res = all_res[world]
    for name in METHODS:
        r = res[name]
        if "error" in r:
            continue
        axes[0].plot(r["losses"], label=f"plait {name}")
        cum = [r["bytes"] * (i + 1) / 2**20 for i in range(len(r["losses"]))]
        axes[1].plot(cum, r["losses"], label=f"plait {name}")
    axes[0].set(xlabel="step", ylabel="loss", title=f"loss vs step (dp {world})")
    axes[1].set(xlabel="cumulative dp bus MiB", ylabel="loss", title="loss vs bytes", xscale="log")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
