"""Muon and Adafactor against AdamW: optimizer step time, optimizer state, the exchange.

Two ranks (dp 2, CPU, gloo, one thread each) train plait's built-in transformer with
``train.optimizer`` AdamW, Muon (Muon on the hidden matrices, AdamW on the rest;
Newton-Schulz in bfloat16, PyTorch's) or Adafactor under plain data parallelism (ZeRO
0), ZeRO-1 and ZeRO-3. Per layout and optimizer: the median time of ``opt.step()``
alone (slowest rank), rank 0's optimizer-state bytes (read from the tensors) with the
planner's prediction beside them (``plait.plan``: ``memory_per_rank(...).optimizer``),
and the bytes rank 0 sends per step inside the step: Muon's owner exchange
(``all_to_all`` on dp: the momentum updates to each matrix's owner, the orthogonalised
updates back) or Adafactor's all-reduced row and column sums (docs/optimizers.md).

Run from the repository root::

    python benchmarks/muon_step.py [--out benchmarks/RESULTS.md]
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

M = "benchmarks.muon_step"
LAYOUTS = (0, 1, 3)
OPTIMIZERS = ("adamw", "muon", "adafactor")
SEQ, VOCAB = 64, 256


def body(ctx: Any, zero: int, optimizer: str, dim: int, layers: int, steps: int) -> dict[str, Any]:
    """``steps`` training steps on this rank; the optimizer step's times and bytes."""
    import torch

    from plait.config import Config, ModelConfig
    from plait.model import Transformer
    from plait.optim import Optimizer
    from plait.parallel.data_parallel import DataParallel
    from plait.parallel.zero import ZeroDataParallel
    from plait.train.matrix_optim import make_adafactor, make_muon
    from plait.train.start import make_optimizer

    torch.set_num_threads(1)
    mesh = ctx.mesh(dp=2)
    seq, vocab = SEQ, VOCAB
    cfg = Config()
    cfg.train.optimizer, cfg.optim.muon_lr = optimizer, 0.02  # type: ignore[assignment]
    net = Transformer(
        ModelConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=4, max_seq_len=seq),
        seed=0,
    )
    model = DataParallel(net, mesh) if zero == 0 else ZeroDataParallel(net, mesh, zero)
    make = {"muon": make_muon, "adafactor": make_adafactor}.get(optimizer)
    inner = make(net, cfg, 1e-3) if make is not None else make_optimizer(net, cfg)
    opt = Optimizer(model, inner, max_norm=1.0)
    g = torch.Generator().manual_seed(mesh.rank)
    times = []
    inner_step = opt.inner.step
    sent = [0.0]
    op = "all_reduce" if optimizer == "adafactor" else "all_to_all"

    def counted() -> None:  # the inner step's traffic (not the clipping norm's)
        before = mesh.stats.get("dp", op).bytes
        inner_step()
        sent[0] = mesh.stats.get("dp", op).bytes - before

    opt.inner.step = counted  # type: ignore[method-assign]
    for i in range(steps + 1):  # the first step (state allocation) is not timed
        x = torch.randint(0, vocab, (4, seq), generator=g)
        torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), x.reshape(-1)).backward()
        t0 = time.perf_counter()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
        opt.zero_grad()
    state = sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    return {"times": times, "state": state, "sent": sent[0]}


def planned_state(zero: int, optimizer: str, dim: int, layers: int) -> float:
    """The planner's optimizer-state bytes on rank 0 of the same run (fp32, dp 2)."""
    from plait.config import ModelConfig
    from plait.plan import HARDWARE_PRESETS, Layout, ModelSpec
    from plait.plan.layout import precision_preset, runtime_preset
    from plait.plan.memory import memory_per_rank
    from plait.plan.optimizer import OptimizerSpec
    from plait.plan.query import Query

    model = ModelConfig(vocab_size=VOCAB, dim=dim, n_layers=layers, n_heads=4, max_seq_len=SEQ)
    layout = Layout(dp=2, zero=zero, micro_batch=4)
    q = Query.of_layout(
        ModelSpec.from_config(model),
        layout,
        HARDWARE_PRESETS["a100-80gb"],  # memory does not read the device
        precision_preset("fp32"),
        runtime_preset("plait"),
        SEQ,
        optimizer=OptimizerSpec(optimizer),  # type: ignore[arg-type]
    )
    return memory_per_rank(q, layout).optimizer


def main(argv: list[str] | None = None) -> int:
    from plait.bench.results import environment, load_average, write_section
    from plait.testing import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", help="rewrite this script's section of this markdown file")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.dim, args.layers, args.steps = 32, 2, 1
    load0 = load_average()
    rows = []
    with WorkerPool(2, comm_timeout_s=300.0) as pool:
        for zero in LAYOUTS:
            for name in OPTIMIZERS:
                res = pool.run(
                    f"{M}:body", zero, name, args.dim, args.layers, args.steps, timeout_s=900.0
                )
                ms = statistics.median(slowest_ms([r["times"] for r in res]))
                r0 = res[0]
                plan = planned_state(zero, name, args.dim, args.layers)
                rows.append(
                    f"| {zero} | {name} | {ms:.1f} | {r0['state']:,} | {plan:,.0f} | "
                    f"{r0['sent']:,.0f} |"
                )
    load1 = load_average()
    text = "\n".join(
        [
            "## Muon and Adafactor against AdamW (CPU, gloo, dp 2): optimizer step and state",
            "",
            f"Measured by `python benchmarks/muon_step.py`; {environment()}; "
            f"{os.cpu_count()} cores, one thread per rank; load average {load0:.1f} -> "
            f"{load1:.1f} (shared machine: times are noisy, bytes are exact).",
            "",
            f"plait's transformer, dim {args.dim}, {args.layers} layers, 2 ranks; median "
            f"`opt.step()` of {args.steps} steps (slowest rank), clipping at 1.0.",
            "",
            "| ZeRO | optimizer | step ms | rank 0 optimizer state B | planner B | "
            "exchange B/step |",
            "|---:|---|---:|---:|---:|---:|",
            *rows,
            "",
            "- State: Muon keeps one momentum per hidden matrix (4 B per element in fp32) "
            "where AdamW keeps two; the embeddings, head and norms keep AdamW's two either "
            "way. From ZeRO 1 on both are sharded over the 2 ranks.",
            "- Adafactor keeps a row and a column factor per matrix and a variance per "
            "vector element: under 1 % of AdamW's bytes. The planner counts what the "
            "tensors hold plus 4 B of `step` per tensor (the measured column leaves the "
            "scalars out); under ZeRO it counts every matrix's factors on each rank (a "
            "rank holding pieces of fewer matrices keeps fewer) and scales the flat "
            "shards' bytes for Muon.",
            "- Exchange: ZeRO 0 has none (each rank holds every matrix whole); at ZeRO 1 "
            "and 3 Muon's rank sends the pieces of the matrices it does not own and the "
            "update pieces of those it owns, Adafactor all-reduces R + C + 2 numbers per "
            "matrix (bus bytes; docs/optimizers.md's formulas).",
            "- Time: Newton-Schulz in bfloat16 on a CPU without bf16 instructions is slow; "
            "the owner scheme divides it over the ranks (ZeRO 1/3) instead of repeating "
            "it on every rank (ZeRO 0).",
        ]
    )
    print(text)
    if args.out:
        write_section(Path(args.out), "muon_step", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
