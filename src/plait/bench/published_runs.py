"""Published large-scale runs whose configuration the papers state, and the planner's
utilisation for them against the reported figure (part 2 of
``benchmarks/planner_vs_measured.py``; tested in ``tests/plan/test_published.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Published:
    """A published run whose configuration the paper states."""

    name: str
    cite: str
    model: Any
    hardware: str
    runtime: str
    seq: int
    layout: Any
    reported: float
    metric: str  # "hfu" (counts recomputation) or "mfu"
    assumptions: str
    alternative: Any = None
    """A layout for what the paper leaves open, reported as a sensitivity figure."""
    alternative_label: str = ""


NARAYANAN = (
    "Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU "
    "Clusters Using Megatron-LM' (SC21, arXiv:2104.04473), table 1: per-GPU throughput "
    "as a percentage of the 312 TFLOP/s peak, FLOPs counted with their eq. 3, which "
    "includes the recomputed forward (= HFU here)"
)
DUBEY = (
    "Dubey et al. 2024, 'The Llama 3 Herd of Models' (arXiv:2407.21783), table 4: BF16 "
    "MFU of Llama 3 405B pre-training at sequence 8192; section 3.3.2: FSDP shards the "
    "optimizer state and gradients but keeps the weights gathered after forward "
    "(ZeRO-2 here), 8K sequences trained without activation checkpointing, an "
    "interleaved pipeline schedule (its figure 6 draws 2 stages per rank)"
)


def published_runs() -> list[Published]:
    """The runs compared in part 2 (configurations as the papers state them)."""
    from dataclasses import replace

    from plait.plan import Layout, ModelSpec
    from plait.plan.modelspec import MODEL_SPECS

    def megatron(
        name: str, layers: int, h: int, heads: int, t: int, p: int, gpus: int, batch: int,
        pct: float,
    ) -> Published:  # fmt: skip
        spec = ModelSpec(name, layers, h, heads, heads, 4 * h, 51200, "gpt", 2048)
        dp = gpus // (t * p)
        lay = Layout(dp=dp, tp=t, pp=p, micro_batch=1, microbatches=batch // dp, recompute="full")
        return Published(
            f"Megatron-LM GPT {name}, {gpus} x A100-80GB",
            NARAYANAN,
            spec,
            "a100-80gb",
            "megatron",
            2048,
            lay,
            pct,
            "hfu",
            f"t={t}, p={p}, {gpus} GPUs, batch {batch}, sequence 2048, vocabulary 51200 as "
            "stated; micro-batch 1, non-interleaved 1F1B, full recomputation and no "
            "sequence parallelism (2021) assumed",
        )

    llama = MODEL_SPECS["llama3-405b"]

    def llama_row(gpus: int, dp: int, per_dp: int, pct: float) -> Published:
        lay = Layout(
            dp=dp, tp=8, pp=16, micro_batch=1, microbatches=per_dp, zero=2,
            schedule="interleaved", chunks=8, recompute="none",
            sequence_parallel=True, pp_grad_reduce="microbatch", edge_trim=1,
        )  # fmt: skip
        return Published(
            f"Llama 3 405B, {gpus} x H100-80GB",
            DUBEY,
            llama,
            "h100-80gb",
            "megatron-flash",
            8192,
            lay,
            pct,
            "mfu",
            f"TP 8, CP 1, PP 16, DP {dp}, {per_dp} sequences of 8192 per DP group as "
            "stated; micro-batch 1, ZeRO-2 with gradients reduce-scattered after each "
            "backward (FSDP), no recomputation, one block fewer on the first and the last "
            "stage (126 = 16 x 8 - 2) as described; interleaved with one block per model "
            "chunk (v=8, the paper does not state v) and Megatron sequence parallelism "
            "assumed",
            replace(lay, chunks=2),
            "v=2",
        )

    return [
        megatron("18.4B", 40, 6144, 48, 8, 1, 256, 1024, 0.43),
        megatron("145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 0.47),
        megatron("1T", 128, 25600, 160, 8, 64, 3072, 3072, 0.52),
        llama_row(8192, 64, 32, 0.43),
        llama_row(16384, 128, 16, 0.41),
    ]


def published_table() -> list[str]:
    """The planner's utilisation against the reported figures."""
    from plait.plan import Query, estimate
    from plait.plan.hardware import hardware_preset
    from plait.plan.layout import PRECISIONS, RUNTIMES

    lines = [
        "| run | metric | reported | planner | error | largest overhead | "
        "memory GiB/rank (fits 80 GB?) | sensitivity |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    cites: list[str] = []
    for r in published_runs():

        def run(layout: Any, r: Published = r) -> Any:
            q = Query.of_layout(
                r.model, layout, hardware_preset(r.hardware), PRECISIONS["bf16-mixed"],
                RUNTIMES[r.runtime], r.seq, headroom=0.0,
            )  # fmt: skip
            return estimate(q, layout)

        e = run(r.layout)
        pred = e.hfu if r.metric == "hfu" else e.mfu
        t = e.time
        over = {
            "bubble": t.bubble, "TP comm": t.tp_comm, "recompute": t.recompute,
            "DP comm": t.dp_comm, "PP comm": t.pp_comm,
        }  # fmt: skip
        big = max(over, key=lambda k: over[k])
        alt = ""
        if r.alternative is not None:
            a = run(r.alternative)
            alt = f"{r.alternative_label}: {100 * (a.hfu if r.metric == 'hfu' else a.mfu):.1f}%"
        if r.cite not in cites:
            cites.append(r.cite)
        ref = cites.index(r.cite) + 1
        lines.append(
            f"| {r.name} [{ref}] | {r.metric.upper()} | {100 * r.reported:.0f}% | "
            f"{100 * pred:.1f}% | {100 * (pred - r.reported):+.1f} points "
            f"({100 * (pred - r.reported) / r.reported:+.0f}%) | "
            f"{big} {100 * over[big] / t.total:.0f}% | "
            f"{e.memory.total / 2**30:.1f} ({'yes' if e.fits else 'no'}) | {alt} |"
        )
        notes.append(f"- {r.name}: {r.assumptions}.")
    refs = [f"[{i}] {c}." for i, c in enumerate(cites, 1)]
    return [*lines, "", *notes, "", *refs]
