"""One transformer block's forward + backward, op by op, beside the planner's charge.

Calibrates this machine's compute rates in this process (one thread,
:func:`plait.bench.measure.compute_body`, CPU time), then for each shape times plait's
:class:`~plait.model.transformer.Block` in training (median of 11 steps, process CPU
time) and profiles it (``torch.profiler``, 3 steps) into three parts: the GEMMs
(``aten::mm``), fused attention (``scaled_dot_product*``), and the rest (memory-bound
operators, autograd nodes, gradient sums, views): the profiler's own total less the two,
so that the three parts are on one clock (the profiler's, wall time per operator; on a
loaded machine that differs from the CPU-time total, which the ratio uses). Beside each
part it prints what :func:`plait.plan.compute.block_time` charges for it: the GEMMs at
the linear-layer rate, attention at its rate, and the memory-bound traffic, operator calls and block
overhead; the last column is the block composition ratio the calibrated profile
charges at that shape (``Hardware.block_scale``, from its grid).

Run from the repository root: ``python benchmarks/planner_block_profile.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

SHAPES = ((32, 2, 128, 8), (64, 4, 128, 8), (128, 4, 128, 8), (128, 4, 128, 4),
          (128, 4, 128, 2), (256, 4, 128, 8))  # fmt: skip
"""(hidden, heads, sequence, micro-batch)."""


def profile_block(hw: Any, dim: int, heads: int, seq: int, mb: int, steps: int = 11) -> str:
    """One row: measured and charged ms per part of one block at this shape (median of
    ``steps`` timed steps after 3 warm-up steps; 3 profiled steps)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from plait.config import ModelConfig
    from plait.model.transformer import Block
    from plait.plan.compute import attention_flops, block_gemms, block_time
    from plait.plan.layout import PRECISIONS, Layout, Runtime
    from plait.plan.modelspec import ModelSpec
    from plait.plan.overheads import block_scale
    from plait.plan.query import Query

    cfg = ModelConfig(n_layers=1, vocab_size=256, dim=dim, n_heads=heads, max_seq_len=seq)
    spec, lay, rt = ModelSpec.from_config(cfg, "block"), Layout(micro_batch=mb), Runtime()
    plain = dataclasses.replace(hw, block_scale=())
    q = Query.of_layout(spec, lay, plain, PRECISIONS["fp32"], rt, seq)
    bt = block_time(q, lay)
    gemm = 3 * sum(g.seconds(plain) for g in block_gemms(q, lay))
    attn = 3 * attention_flops(spec, lay, seq) / plain.attention.at(seq)
    rest = bt.forward + bt.backward - gemm - attn
    blk = Block(cfg)
    for p in blk.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(mb, seq, dim, requires_grad=True)  # (batch, seq, hidden)
    cos, sin = torch.rand(seq, cfg.head_dim // 2), torch.rand(seq, cfg.head_dim // 2)
    g = torch.randn(mb, seq, dim)

    def step() -> None:
        for p in (*blk.parameters(), x):
            p.grad = None
        blk(x, cos, sin).backward(g)

    for _ in range(3):
        step()
    ts = []
    for _ in range(steps):
        c = time.process_time()
        step()
        ts.append(time.process_time() - c)
    meas = statistics.median(ts)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
    ev = prof.key_averages()
    mm = sum(e.self_cpu_time_total for e in ev if e.key in ("aten::mm", "aten::bmm")) / 3e6
    sd = sum(e.self_cpu_time_total for e in ev if "scaled_dot_product" in e.key) / 3e6
    total = sum(e.self_cpu_time_total for e in ev) / 3e6  # the profiler's clock throughout
    ms = lambda v: f"{1e3 * v:.2f}"  # noqa: E731
    charged = bt.forward + bt.backward
    return (
        f"| {dim} x {mb * seq} (h{heads}) | {ms(meas)} / {ms(charged)} | {meas / charged:.3f} | "
        f"{ms(total)} | {ms(mm)} / {ms(gemm)} | {ms(sd)} / {ms(attn)} | "
        f"{ms(total - mm - sd)} / {ms(rest)} | "
        f"{block_scale(hw, dim, mb * seq):.3f} |"
    )


def main() -> int:
    import torch

    from plait.bench.calibrate import profile_from_results
    from plait.bench.measure import compute_body

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    a = ap.parse_args()
    shapes, steps = (SHAPES[:1], 1) if a.tiny else (SHAPES, 11)
    torch.set_num_threads(1)
    comp = compute_body(None, a.tiny)  # --tiny: the quick calibration
    hw, _ = profile_from_results([{"compute": comp, "comm": {"cpu": {}}}], 4e9, clock="cpu")
    print(
        "| hidden x tokens | block ms meas / charged | ratio | profiled | "
        "GEMM ms prof / charged | attention | rest (memory-bound, autograd, overhead) | "
        "profile's block ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        print(profile_block(hw, *shape, steps=steps), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
