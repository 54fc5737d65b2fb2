"""Muon against AdamW: optimizer step time, optimizer state and the owner exchange.

Two ranks (dp 2, CPU, gloo, one thread each) train plait's built-in transformer with
``train.optimizer`` AdamW or Muon (Muon on the hidden matrices, AdamW on the rest;
Newton-Schulz in bfloat16, PyTorch's) under plain data parallelism (ZeRO 0), ZeRO-1
and ZeRO-3. Per layout and optimizer: the median time of ``opt.step()`` alone (slowest
rank), rank 0's optimizer-state bytes (read from the tensors), and the bytes rank 0
sends per step in Muon's owner exchange (``all_to_all`` on dp: the momentum updates to
each matrix's owner, the orthogonalised updates back; docs/optimizers.md).

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
OPTIMIZERS = ("adamw", "muon")


def body(ctx: Any, zero: int, optimizer: str, dim: int, layers: int, steps: int) -> dict[str, Any]:
    """``steps`` training steps on this rank; the optimizer step's times and bytes."""
    import torch

    from plait.config import Config, ModelConfig
    from plait.model import Transformer
    from plait.optim import Optimizer
    from plait.parallel.data_parallel import DataParallel
    from plait.parallel.zero import ZeroDataParallel
    from plait.train.matrix_optim import make_muon
    from plait.train.trainer import make_optimizer

    torch.set_num_threads(1)
    mesh = ctx.mesh(dp=2)
    seq, vocab = 64, 256
    cfg = Config()
    cfg.train.optimizer, cfg.optim.muon_lr = optimizer, 0.02  # type: ignore[assignment]
    net = Transformer(
        ModelConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=4, max_seq_len=seq),
        seed=0,
    )
    model = DataParallel(net, mesh) if zero == 0 else ZeroDataParallel(net, mesh, zero)
    inner = make_muon(net, cfg, 1e-3) if optimizer == "muon" else make_optimizer(net, cfg)
    opt = Optimizer(model, inner, max_norm=1.0)
    g = torch.Generator().manual_seed(mesh.rank)
    times = []
    for i in range(steps + 1):  # the first step (state allocation) is not timed
        x = torch.randint(0, vocab, (4, seq), generator=g)
        torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), x.reshape(-1)).backward()
        before = mesh.stats.get("dp", "all_to_all").bytes
        t0 = time.perf_counter()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
        sent = mesh.stats.get("dp", "all_to_all").bytes - before
        opt.zero_grad()
    state = sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    return {"times": times, "state": state, "sent": sent}


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
                rows.append(
                    f"| {zero} | {name} | {ms:.1f} | {r0['state']:,} | {r0['sent']:,.0f} |"
                )
    load1 = load_average()
    text = "\n".join(
        [
            "## Muon against AdamW (CPU, gloo, dp 2): optimizer step and state per rank",
            "",
            f"Measured by `python benchmarks/muon_step.py`; {environment()}; "
            f"{os.cpu_count()} cores, one thread per rank; load average {load0:.1f} -> "
            f"{load1:.1f} (shared machine: times are noisy, bytes are exact).",
            "",
            f"plait's transformer, dim {args.dim}, {args.layers} layers, 2 ranks; median "
            f"`opt.step()` of {args.steps} steps (slowest rank), clipping at 1.0.",
            "",
            "| ZeRO | optimizer | step ms | rank 0 optimizer state B | owner exchange B/step |",
            "|---:|---|---:|---:|---:|",
            *rows,
            "",
            "- State: Muon keeps one momentum per hidden matrix (4 B per element in fp32) "
            "where AdamW keeps two; the embeddings, head and norms keep AdamW's two either "
            "way. From ZeRO 1 on both are sharded over the 2 ranks.",
            "- Exchange: ZeRO 0 has none (each rank holds every matrix whole); at ZeRO 1 "
            "and 3 a rank sends the pieces of the matrices it does not own and the update "
            "pieces of those it owns (docs/optimizers.md's formula).",
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
