"""Context parallelism on CPU: memory reach, ring vs Ulysses vs all-gather, ring overlap.

Tables (cp 1, 2, 4 as gloo ranks of one thread each on this machine):

(a) the longest sequence (on a grid of powers of two) whose saved activations of one
    transformer block (forward, measured with saved-tensor hooks, slowest rank) fit a
    fixed per-rank budget, next to the planner's prediction
    (:func:`plait.plan.activations.layer_activation_bytes`, fp32, plait runtime);
(b) one attention layer's forward + backward at a fixed sequence: time (median of the
    slowest rank) as a ratio to one process running torch's SDPA on the whole sequence,
    and the bytes each rank sent on the cp axis (from ``mesh.stats``), for ring attention
    (zigzag), Ulysses (all-to-all) and the naive baseline that all-gathers K/V on every
    rank (reduce-scatter of dK/dV in backward);
(c) the share of ring communication hidden behind block compute, from the recorded
    timeline: per step, the transfer runs from its post to the end of its wait; the part
    after the block's compute ended (time blocked in wait) is exposed.

PyTorch's own ``torch.distributed.tensor.experimental.context_parallel`` does not run
on CPU (its SDPA sharding rules cover only the CUDA flash/efficient kernels), so there is
no PyTorch CP row here. Usage: ``python benchmarks/context_parallel.py [--out
benchmarks/RESULTS.md]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the pool's workers resolve the bodies by module name
    sys.path.insert(0, str(ROOT))

M = "benchmarks.context_parallel"
DIM, HEADS, KV_HEADS = 64, 4, 2
BUDGET_MIB = 24.0
GRID = [512 * 2**k for k in range(7)]  # 512 .. 32768
SEQ_B, HEADS_B, KV_B, HEAD_DIM_B = 2048, 4, 2, 32
REPEATS = 5


def _block_cfg(seq: int) -> Any:
    from plait.config import ModelConfig

    return ModelConfig(
        vocab_size=256, dim=DIM, n_layers=1, n_heads=HEADS, n_kv_heads=KV_HEADS, max_seq_len=seq
    )


def saved_body(ctx: Any, seq: int) -> int:
    """Bytes one transformer block saves for backward on this rank at sequence ``seq``."""
    import torch

    from plait.model.transformer import Block, rope_tables
    from plait.parallel.context.layout import local_positions
    from plait.parallel.context.ring_attention import RingAttention

    torch.set_num_threads(1)
    mesh = ctx.mesh(dp=1, cp=ctx.world_size)
    cp, me = mesh.size("cp"), mesh.index("cp")
    cfg = _block_cfg(seq)
    torch.manual_seed(0)
    block = Block(cfg)
    if cp > 1:
        block.attention.core = RingAttention(mesh.axis("cp"))
    cos, sin = rope_tables(cfg.head_dim, seq, cfg.rope_theta)
    pos = local_positions("zigzag", cp, me, seq // cp)
    x = torch.randn(1, seq // cp, DIM, requires_grad=True)
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cos[pos], sin[pos])
    return total


def attention_body(ctx: Any, kind: str, repeats: int, seq: int = SEQ_B) -> dict[str, Any]:
    """Forward + backward of one attention layer's core at ``seq``, ``repeats`` times."""
    import torch

    from plait.comm import barrier
    from plait.comm.regions import gather_from_sequence
    from plait.parallel.context.layout import shard_sequence
    from plait.parallel.context.ring_attention import RingAttention
    from plait.parallel.context.ulysses_attention import UlyssesAttention

    torch.set_num_threads(1)
    mesh = ctx.mesh(dp=1, cp=ctx.world_size)
    cp, me, g = mesh.size("cp"), mesh.index("cp"), mesh.axis("cp")
    gen = torch.Generator().manual_seed(1)
    full = [
        torch.randn(1, h, seq, HEAD_DIM_B, generator=gen) for h in (HEADS_B, KV_B, KV_B, HEADS_B)
    ]
    layout = "zigzag" if kind == "ring" else "contiguous"
    q, k, v, dout = (shard_sequence(t, layout, cp, me, dim=2) for t in full)  # type: ignore[arg-type]
    ring = RingAttention(g, record_events=True) if kind == "ring" else None
    ulysses = UlyssesAttention(g) if kind == "ulysses" else None
    n = seq // cp
    rows = torch.arange(me * n, (me + 1) * n)[:, None]
    mask = torch.arange(seq)[None, :] <= rows  # (local queries, all keys), True = visible

    def run(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        if ring is not None:
            return ring(qq, kk, vv)
        if ulysses is not None:
            return ulysses(qq, kk, vv)
        kf = gather_from_sequence(kk, g, dim=2)  # (1, kv, S, d): all-gather / reduce-scatter
        vf = gather_from_sequence(vv, g, dim=2)
        return torch.nn.functional.scaled_dot_product_attention(
            qq, kf, vf, attn_mask=mask, enable_gqa=True
        )

    times, hidden = [], []
    for i in range(repeats + 1):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        if ring is not None:
            ring.events.clear()
        barrier(mesh.world())
        mesh.stats.reset()
        t0 = time.perf_counter()
        run(qq, kk, vv).backward(dout)
        dt = time.perf_counter() - t0
        if i == 0:
            continue  # warm-up
        times.append(dt)
        if ring is not None:
            hidden.append(_hidden_share(ring.events, cp))
    sent = mesh.stats.get("cp", "send").bytes + sum(
        mesh.stats.get("cp", op).bytes for op in ("all_to_all", "all_gather", "reduce_scatter")
    )
    return {"times": times, "bytes": sent, "hidden": hidden}


def _hidden_share(events: list[tuple[str, int, float]], cp: int) -> float:
    """Forward ring: the share of each transfer's span (post -> wait done) that passed
    while the block computed (before its compute ended)."""
    fwd = events[: 4 * (cp - 1) + 2]  # post/compute_start/compute_end/wait per step
    ev = {(w, s): t for w, s, t in fwd}
    span = exposed = 0.0
    for step in range(1, cp):
        post, done, end = ev[("post", step)], ev[("wait", step)], ev[("compute_end", step - 1)]
        span += done - post
        exposed += max(0.0, done - end)
    return 1.0 - exposed / span if span > 0 else 1.0


def reference_seconds(repeats: int, seq: int = SEQ_B) -> float:
    """One process: torch SDPA (causal, GQA) forward + backward on the whole sequence."""
    import torch

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (
        torch.randn(1, h, seq, HEAD_DIM_B, generator=gen) for h in (HEADS_B, KV_B, KV_B, HEADS_B)
    )
    times = []
    for i in range(repeats + 1):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        t0 = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(
            qq, kk, vv, is_causal=True, enable_gqa=True
        ).backward(dout)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def planner_bytes(cp: int, seq: int) -> float:
    from plait.plan.activations import layer_activation_bytes
    from plait.plan.hardware import PRESETS
    from plait.plan.layout import PRECISIONS, RUNTIMES, Layout
    from plait.plan.modelspec import ModelSpec
    from plait.plan.query import Query

    cfg = _block_cfg(seq)
    spec = ModelSpec("bench", 1, DIM, HEADS, KV_HEADS, cfg.hidden_dim, 256, "llama", seq)
    lay, hw = Layout(cp=cp), PRESETS["a100-80gb"]  # memory only: the device is not read
    return layer_activation_bytes(
        Query.of_layout(spec, lay, hw, PRECISIONS["fp32"], RUNTIMES["plait"], seq), lay
    )


def main(argv: list[str] | None = None) -> int:
    from plait.bench.results import load_average, write_section
    from plait.testing import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", help="rewrite this script's section of this markdown file")
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--max-seq", type=int, default=GRID[-1], help="largest sequence tried in (a)")
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="cp sizes")
    ap.add_argument("--seq", type=int, default=SEQ_B, help="sequence of tables (b), (c)")
    ap.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.repeats, args.max_seq, args.cp, args.seq = 1, GRID[0], [1, 2], 256
    load0 = load_average()
    budget = BUDGET_MIB * 2**20
    reach: list[str] = []
    timing: list[str] = []
    ref = reference_seconds(args.repeats, args.seq)
    for cp in args.cp:
        with WorkerPool(cp, comm_timeout_s=300.0) as pool:
            fit, fit_bytes = 0, 0.0
            for seq in (s for s in GRID if s <= args.max_seq):
                got = max(pool.run(f"{M}:saved_body", seq, timeout_s=600.0))
                if got > budget:
                    break
                fit, fit_bytes = seq, got
            pred = max((s for s in GRID if planner_bytes(cp, s) <= budget), default=0)
            reach.append(
                f"| {cp} | {fit:,} | {fit_bytes / 2**20:.2f} | {pred:,} | "
                f"{planner_bytes(cp, fit) / 2**20 if fit else 0:.2f} |"
            )
            if cp == 1:
                timing.append(f"| 1 | torch SDPA (reference) | 1.00 | {1e3 * ref:.1f} | 0 | |")
                continue
            for kind in ("ring", "ulysses", "allgather"):
                res = pool.run(
                    f"{M}:attention_body", kind, args.repeats, args.seq, timeout_s=600.0
                )
                per_step = [max(ts) for ts in zip(*(r["times"] for r in res), strict=True)]
                t = statistics.median(per_step)
                shares = [h for r in res for h in r["hidden"]]
                hid = statistics.median(shares) if shares else None
                timing.append(
                    f"| {cp} | {kind} | {t / ref:.2f} | {1e3 * t:.1f} | "
                    f"{max(r['bytes'] for r in res):,.0f} | "
                    f"{'' if hid is None else f'{100 * hid:.0f} %'} |"
                )
    load1 = load_average()
    text = "\n".join(
        [
            "## Context parallelism (CPU, gloo): memory reach, ring vs Ulysses vs all-gather",
            "",
            f"(a) Longest sequence (grid 512·2^k) whose saved activations of one transformer "
            f"block (dim {DIM}, {HEADS} heads, {KV_HEADS} KV heads, fp32, batch 1) fit "
            f"{BUDGET_MIB:g} MiB per rank; ring attention (zigzag) at cp > 1.",
            "",
            "| cp | longest seq measured | MiB saved there (slowest rank) | planner: longest seq "
            "| planner MiB at the measured seq |",
            "|---:|---:|---:|---:|---:|",
            *reach,
            "",
            f"(b), (c) One attention core, causal GQA ({HEADS_B} heads, {KV_B} KV heads, head "
            f"dim {HEAD_DIM_B}), sequence {args.seq}, batch 1, fp32, forward + backward; median "
            f"of {args.repeats} (slowest rank each) after one warm-up; ratio to one process "
            "running torch SDPA on the whole sequence; bytes each rank sent on the cp axis "
            "(bus bytes, forward + backward); hidden = share of the forward ring transfers' "
            "span that overlapped the current block's compute.",
            "",
            "| cp | attention | time / SDPA one process | ms | bytes sent per rank | ring hidden |",
            "|---:|---|---:|---:|---:|---:|",
            *timing,
            "",
            f"- Load average {load0:.1f} -> {load1:.1f} on {_cores()} cores (the machine was "
            "shared with other jobs; cp ranks oversubscribe it at cp 4), torch "
            f"{_torch_version()}; one thread per rank. Command: `python "
            "benchmarks/context_parallel.py --out benchmarks/RESULTS.md`.",
            "- PyTorch's `context_parallel` (torch.distributed.tensor.experimental) does not "
            "run on CPU: its SDPA sharding covers only the CUDA flash / efficient kernels, so "
            "there is no PyTorch row on this machine.",
        ]
    )
    print(text)
    if args.out:
        write_section(Path(args.out), "context_parallel", text)
    return 0


def _cores() -> int:
    import os

    return os.cpu_count() or 1


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


if __name__ == "__main__":
    raise SystemExit(main())
