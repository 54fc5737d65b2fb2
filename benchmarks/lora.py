"""LoRA against full fine-tuning: state per rank and step time at dp2 and ZeRO-3 dp2.

Two ranks (dp 2, CPU, gloo, one thread each) train plait's built-in transformer in full
(every weight trained, AdamW) and with LoRA adapters of rank 8 and 16 on all seven
projections (the base frozen), under plain data parallelism (ZeRO 0) and ZeRO-3, from
the same weights on the same batches. Per run: rank 0's state bytes counted from the
tensors (:func:`plait.train.memory.memory_report`: weights, the frozen base included,
gradients, fp32 masters, optimizer state) beside the planner's figure for the same
layout (:func:`plait.plan.memory.memory_per_rank` with ``Query.lora``), the median
time of a whole step (forward, backward, reduction, optimizer; slowest rank), and both
as a ratio to the full fine-tuning run of the same layout measured in the same script.

Run from the repository root::

    python benchmarks/lora.py [--out benchmarks/RESULTS.md] [--dtype bf16]
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
if str(ROOT) not in sys.path:  # the pool's workers resolve the bodies by module name
    sys.path.insert(0, str(ROOT))

from plait.bench.timing import slowest_ms  # noqa: E402

M = "benchmarks.lora"
ZEROS = (0, 3)
RANKS = (None, 8, 16)
"""The LoRA rank of each run; None is full fine-tuning."""
SEQ, VOCAB, BATCH = 64, 256, 4
STATE_KEYS = ("params", "grads", "master", "optimizer")


def _model_config(dim: int, layers: int) -> Any:
    from plait.config import ModelConfig

    return ModelConfig(vocab_size=VOCAB, dim=dim, n_layers=layers, n_heads=4, max_seq_len=SEQ)


def body(
    ctx: Any, zero: int, rank: int | None, dim: int, layers: int, steps: int, dtype: str
) -> dict[str, Any]:
    """``steps`` + 1 training steps on this rank (the first, which allocates the optimizer
    state, not timed); the step times and this rank's state bytes."""
    import torch

    from plait.config import LoraConfig
    from plait.model import Transformer
    from plait.optim import Optimizer
    from plait.parallel.parallelize import parallelize
    from plait.train.memory import memory_report

    torch.set_num_threads(1)
    mesh = ctx.mesh(dp=2)
    lora = None if rank is None else LoraConfig(rank=rank, alpha=2.0 * rank)
    net = Transformer(_model_config(dim, layers), seed=0)
    pm = parallelize(net, mesh, zero=zero, precision=dtype, lora=lora)
    trained = [p for p in pm.parameters() if p.requires_grad]
    opt = Optimizer(pm, torch.optim.AdamW(trained, lr=1e-3))
    g = torch.Generator().manual_seed(mesh.rank)
    times = []
    for i in range(steps + 1):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        t0 = time.perf_counter()
        pm.step(x, x)
        opt.step()
        opt.zero_grad()
        if i:
            times.append(time.perf_counter() - t0)
    b = memory_report(pm, opt, mesh.rank).bytes
    state = {k: b[k] for k in STATE_KEYS[:3]}
    state["optimizer"] = b["optimizer"] + b["optimizer_scalars"]
    return {"times": times, "state": state}


def planned(zero: int, rank: int | None, dim: int, layers: int, dtype: str) -> dict[str, float]:
    """The planner's state bytes of rank 0 for the same run."""
    from plait.plan import HARDWARE_PRESETS
    from plait.plan.layout import PRECISIONS, RUNTIMES, Layout
    from plait.plan.lora import LoraSpec
    from plait.plan.memory import memory_per_rank
    from plait.plan.modelspec import ModelSpec
    from plait.plan.query import Query

    layout = Layout(dp=2, zero=zero)
    q = Query.of_layout(
        ModelSpec.from_config(_model_config(dim, layers)),
        layout,
        HARDWARE_PRESETS["a100-80gb"],  # memory does not read the device
        PRECISIONS["fp32" if dtype == "fp32" else "bf16-mixed"],
        RUNTIMES["plait"],
        SEQ,
        0.0,
        None,
        None if rank is None else LoraSpec(rank, "q,k,v,o,gate,up,down"),
    )
    mem = memory_per_rank(q, layout, 0)
    return {
        "params": mem.params,
        "grads": mem.grads,
        "master": mem.master,
        "optimizer": mem.optimizer,
    }


def main(argv: list[str] | None = None) -> int:
    from plait.bench.results import environment, load_average, write_section
    from plait.testing import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", help="rewrite this script's section of this markdown file")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: the frozen base in bf16, trained weights with fp32 masters",
    )
    ap.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.dim, args.layers, args.steps = 32, 1, 1
    load0 = load_average()
    rows = []
    with WorkerPool(2, comm_timeout_s=300.0) as pool:
        for zero in ZEROS:
            full_state = full_ms = 0.0
            for rank in RANKS:
                res = pool.run(
                    f"{M}:body",
                    zero,
                    rank,
                    args.dim,
                    args.layers,
                    args.steps,
                    args.dtype,
                    timeout_s=900.0,
                )
                ms = statistics.median(slowest_ms([r["times"] for r in res]))
                got = sum(res[0]["state"].values())
                plan = planned(zero, rank, args.dim, args.layers, args.dtype)
                want = sum(plan.values())
                if rank is None:
                    full_state, full_ms = got, ms
                b = res[0]["state"]
                name = "full" if rank is None else f"lora r{rank}"
                rows.append(
                    f"| {zero} | {name} | {b['params']:,} | {b['grads']:,} | "
                    f"{b['master'] + b['optimizer']:,} | {got:,} | {want:,.0f} | "
                    f"{got / full_state:.3f} | {ms:.1f} | {ms / full_ms:.2f} |"
                )
    load1 = load_average()
    text = "\n".join(
        [
            "## LoRA against full fine-tuning (CPU, gloo, dp 2): state per rank, step time",
            "",
            f"Measured by `python benchmarks/lora.py --dtype {args.dtype}`; {environment()}; "
            f"{os.cpu_count()} cores, one thread per rank; load average {load0:.1f} -> "
            f"{load1:.1f} (shared machine: times are noisy, bytes are exact).",
            "",
            f"plait's transformer, dim {args.dim}, {args.layers} layers, vocabulary {VOCAB}, "
            f"{BATCH} x {SEQ} tokens per rank, AdamW; LoRA on q,k,v,o,gate,up,down (alpha "
            f"2 x rank). Rank 0's bytes counted from the tensors, the planner's total beside "
            f"them; median whole step of {args.steps} (slowest rank); ratios against the "
            "full run of the same ZeRO stage.",
            "",
            "| ZeRO | run | weights B | grads B | masters + optimizer B | state B "
            "| planner B | state / full | step ms | step / full |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "- State: LoRA keeps gradients, masters and AdamW's moments for the adapters "
            "only; the frozen base is held whole on every rank, in the compute dtype, also "
            "under ZeRO-3 (it is not sharded yet: docs/fine-tuning.md), so ZeRO-3's saving "
            "on the base weights is lost and the ratio there is larger than at ZeRO 0.",
            "- Time: the forward and the backward through the activations are the same "
            "work; LoRA skips the base weights' gradient products, their reduction and "
            "their optimizer step, and adds the small adapter products.",
        ]
    )
    print(text)
    if args.out:
        write_section(Path(args.out), "lora", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
