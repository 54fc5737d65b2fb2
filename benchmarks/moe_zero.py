"""ZeRO under expert parallelism on CPU: per-rank state bytes and traffic per step.

One table: an MoE transformer (8 experts top-2, 4 layers, MoE on every second) on 4
gloo ranks (dp 4) at ep 2 (expert replica groups of 2) with ZeRO 0-3 (fp32, and bf16
with fp32 masters at ZeRO 3); per rank (rank 0): parameters, gradients, fp32 masters and
Adam state in bytes read from the tensors (``plait.train.memory.memory_report`` after a
step), the expert units' share of them, the bytes sent per step on the dp axis and on
the expert replica axis (``ep_replica``) and the all-to-all (``ep``), and the median step
time (slowest rank). The expert weights' state falls with the replica group (2), the
dense weights' with dp (4).

Usage: ``python benchmarks/moe_zero.py [--out benchmarks/RESULTS.md]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from plait.bench.timing import slowest_ms

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the pool's workers resolve the bodies by module name
    sys.path.insert(0, str(ROOT))

M = "benchmarks.moe_zero"
DIM, LAYERS, EXPERTS, TOP_K, EXPERT_FFN, SEQ, BATCH = 128, 4, 8, 2, 128, 64, 16
REPEATS = 3
LAYOUTS = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (3, "bf16")]


def _cfg() -> Any:
    from plait.config import ModelConfig

    return ModelConfig(
        vocab_size=256, dim=DIM, n_layers=LAYERS, n_heads=4, max_seq_len=SEQ,
        moe_experts=EXPERTS, moe_top_k=TOP_K, moe_hidden_dim=EXPERT_FFN, moe_every=2,
    )  # fmt: skip


def _nbytes(t: Any) -> int:
    return 0 if t is None else int(t.numel() * t.element_size())


def body(ctx: Any, ep: int, zero: int, dtype: str, repeats: int) -> dict[str, Any]:
    """Steps of the MoE model on this rank: state bytes, bytes per axis, step times."""
    import torch

    from plait.config import ParallelConfig
    from plait.model import Transformer
    from plait.optim import Optimizer
    from plait.parallel.parallelize import parallelize
    from plait.train.memory import memory_report

    torch.set_num_threads(1)
    mesh = ctx.mesh(dp=ctx.world_size)
    cfg = ParallelConfig(ep=ep, zero=zero)
    pm = parallelize(Transformer(_cfg(), seed=0), mesh, cfg, precision=dtype)
    opt = Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(mesh.rank)
    per = BATCH // ctx.world_size
    times: list[float] = []
    axes: dict[str, float] = {}
    for i in range(repeats + 1):
        x = torch.randint(0, 256, (per, SEQ), generator=g)
        mesh.stats.reset()
        t0 = time.perf_counter()
        pm.step(x, x)
        opt.step()
        if i == 0:
            rep = memory_report(pm, opt, mesh.rank).bytes
        opt.zero_grad()
        if i:
            times.append(time.perf_counter() - t0)
            for a in ("dp", "ep_replica", "ep"):
                axes[a] = mesh.stats.total_bytes(a)
    expert = 0
    if pm.zero is not None:  # the expert units' gradient buffers (ZeRO 2/3: shards)
        for u in pm.zero.units:
            if u.groups is not None:
                expert += _nbytes(u.grad_full if u.grad_full is not None else u.grad_shard)
    elif pm.experts is not None and pm.experts.sync is not None:
        expert = _nbytes(pm.experts.sync.buffer)  # plain DP: the expert reduction's buffer
    return {"rep": rep, "axes": axes, "times": times, "expert_grads": expert}


def main(argv: list[str] | None = None) -> int:
    from plait.bench.results import environment, load_average, write_section
    from plait.testing import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", help="rewrite this script's section of this markdown file")
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--world", type=int, default=4, help="ranks (dp); ep 2")
    ap.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    args = ap.parse_args(argv)
    if args.tiny:  # ep 2 on 2 ranks: expert replica groups of 1
        args.repeats, args.world = 1, 2
    load0 = load_average()
    rows = []
    with WorkerPool(args.world, comm_timeout_s=300.0) as pool:
        for zero, dtype in LAYOUTS:
            res = pool.run(f"{M}:body", 2, zero, dtype, args.repeats, timeout_s=900.0)
            r0 = res[0]
            b = r0["rep"]
            t = statistics.median(slowest_ms([r["times"] for r in res])) / 1e3  # seconds
            ax = r0["axes"]
            rows.append(
                f"| {zero} | {dtype} | {b['params']:,} | {b['grads']:,} | "
                f"{r0['expert_grads']:,} | {b['master']:,} | {b['optimizer']:,} | "
                f"{ax['dp']:,.0f} | {ax['ep_replica']:,.0f} | {ax['ep']:,.0f} | {1e3 * t:.0f} |"
            )
    load1 = load_average()
    text = "\n".join(
        [
            "## ZeRO under expert parallelism (CPU, gloo): state bytes and traffic per rank",
            "",
            f"Measured by `python benchmarks/moe_zero.py`; {environment()}; "
            f"{os.cpu_count()} cores, one thread per rank; load average {load0:.1f} -> "
            f"{load1:.1f} (shared machine: times are noisy, bytes are exact).",
            "",
            f"A {LAYERS}-layer MoE transformer (dim {DIM}, {EXPERTS} experts top-{TOP_K} "
            f"of width {EXPERT_FFN} on every second layer) on 4 ranks (dp 4) at ep 2: each "
            "rank holds 4 experts per MoE layer, replicated by 2 ranks (`ep_replica`). "
            f"Global batch {BATCH} x {SEQ} tokens. Rank 0's state after one AdamW step "
            "(bytes read from the tensors), of it the expert weights' gradient bytes, and "
            f"the bus bytes it sends per step on each axis; median step of {args.repeats} "
            "(slowest rank).",
            "",
            "| ZeRO | dtype | params B | grads B | of it expert grads B | fp32 masters B | "
            "Adam state B | dp B/step | ep_replica B/step | ep (all-to-all) B/step | "
            "step ms |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "- Expert gradients: at ZeRO 0 (plain DP: the expert reduction's buffer) and 1 "
            "a rank keeps its 4 experts' full gradients (2 MoE layers x 4 x 3 x 128 x 128 x "
            "4 B = 1,572,864 B); at ZeRO 2/3 half of them, the shard over the 2 ranks of "
            "the expert replica group, while the dense units' shards are 1/4 (dp). Adam "
            "state (and bf16's fp32 masters) are sharded the same way from ZeRO 1 on.",
            "- Traffic: the expert gradients move only on `ep_replica`: S = 1,572,864 B of "
            "bus bytes per step at ZeRO 0 (all-reduce, 2 (R-1)/R S) and ZeRO 1/2 "
            "(reduce-scatter + all-gather of the updated shards), 1.5 S at ZeRO 3 (gathered "
            "for forward and for backward, reduce-scattered); bf16 halves every figure. The "
            "all-to-all (`ep`) is the same at every stage.",
            "- Times: 4 ranks on 2 shared cores; ZeRO 3 pays for the gathers, bf16 is slow "
            "on this CPU (no bf16 instructions). No GPU figures.",
        ]
    )
    print(text)
    if args.out:
        write_section(Path(args.out), "moe_zero", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
