"""The pipeline schedule's fixed cost per compute action, measured on a tiny pipeline.

A pipeline rank runs, per micro-batch, a forward and a backward action of each of its
pieces; each pays, beyond its piece's own work, the schedule's Python, one autograd
backward call per action, the detach / ``requires_grad`` of its messages and a receive
buffer. :func:`measure_pipeline` times, on pairs of ranks and on both clocks,
:func:`plait.parallel.pipeline.runtime.pipeline_step` (1F1B, :data:`TINY_PP_MICRO`
micro-batches of :data:`TINY_PP_BATCH` sequences, one tiny block per stage) and, in
alternation (so that a change of background load hits both alike), the same rank's
piece run plainly on the same micro-batches (forward and backward, no messages).
:func:`pipeline_overhead` solves the planner's pipeline time for the cost ``x`` of one
action on each rank and keeps the slowest::

    t_pipeline = n·(t_plain / m + c + 2·x) + t_loss,   n = m (+ p - 1 on the wall clock)

with ``c`` the planner's two messages per micro-batch and ``t_loss`` its loss
broadcast (:mod:`plait.plan.overheads`): a difference of two measurements on the same
rank, so the compute rates (and their noise) drop out.
"""

from __future__ import annotations

import statistics
from typing import Any

from plait.bench.measure import CLOCKS, TINY_BLOCK
from plait.plan.hardware import Hardware

TINY_PP_MICRO = 4
"""Micro-batches of the tiny pipeline (as the benchmark's pp2 row)."""
TINY_PP_BATCH = 1
"""Sequences per micro-batch of the tiny pipeline."""
TINY_PP_LAYERS = 2
"""Blocks of the tiny model (one per stage)."""


def _tiny_config() -> Any:
    from plait.config import ModelConfig

    t = TINY_BLOCK
    return ModelConfig(
        n_layers=TINY_PP_LAYERS,
        vocab_size=256,
        dim=t["dim"],
        n_heads=t["n_heads"],
        max_seq_len=t["max_seq_len"],
    )


def measure_pipeline(mesh: Any, reps: int) -> dict[str, dict[str, float]]:
    """Seconds of one tiny 1F1B pipeline step (forward, backward, loss broadcast) over
    the pp axis of ``mesh`` (2 stages) and of this rank's piece run plainly on the same
    micro-batches, per clock (medians of ``reps``, alternated)."""
    import torch
    import torch.nn.functional as F

    from plait import comm
    from plait.model.transformer import Transformer
    from plait.parallel.pipeline.runtime import PipelineRuntime, pipeline_step
    from plait.parallel.pipeline.schedules import build_schedule
    from plait.parallel.pipeline.split import split_transformer

    cfg = _tiny_config()
    s, m, b = cfg.max_seq_len, TINY_PP_MICRO, TINY_PP_BATCH
    stages = split_transformer(Transformer(cfg, seed=0), mesh)
    group = mesh.axis("pp")

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float().flatten(0, 1), y.flatten())

    schedule = build_schedule("1f1b", group.size, m, 1)
    runtime = PipelineRuntime(stages, schedule, group, loss_fn, (b, s, cfg.dim), torch.float32)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (m * b, s), generator=gen)  # (m·b, s)
    y = torch.randint(0, cfg.vocab_size, (m * b, s), generator=gen)
    piece = stages.chunks[0]
    first, last = piece.tok_embeddings is not None, piece.output is not None
    hidden = torch.randn(b, s, cfg.dim, generator=gen)  # (b, s, dim): a received message

    def pipelined() -> None:
        pipeline_step(stages, runtime, x, y)

    def plain() -> None:
        for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
            inp = xs if first else hidden.clone().requires_grad_(True)
            out = piece(inp)
            if last:
                loss_fn(out, ys).backward()
            else:
                out.backward(torch.ones_like(out))

    def timed(fn: Any) -> dict[str, float]:
        start = {c: clock() for c, clock in CLOCKS.items()}
        fn()
        for p in stages.parameters():
            p.grad = None
        return {c: clock() - start[c] for c, clock in CLOCKS.items()}

    timed(pipelined)
    timed(plain)
    comm.barrier(group)
    runs: dict[str, list[dict[str, float]]] = {"pipeline": [], "plain": []}
    for _ in range(reps):
        runs["pipeline"].append(timed(pipelined))
        runs["plain"].append(timed(plain))
    comm.barrier(group)  # the plain runs of the two ranks end apart
    return {c: {k: statistics.median(r[c] for r in v) for k, v in runs.items()} for c in CLOCKS}


def pipeline_comm_charge(hw: Hardware) -> tuple[float, float]:
    """(per micro-batch, per step) seconds the planner charges the tiny pipeline for its
    two messages per micro-batch and for its loss broadcast."""
    from plait.plan.layout import PRECISIONS
    from plait.plan.network import group, p2p_time
    from plait.plan.overheads import pipeline_loss_seconds

    cfg = _tiny_config()
    lay = _tiny_layout()
    msg = TINY_PP_BATCH * cfg.max_seq_len * cfg.dim * PRECISIONS["fp32"].activation_bytes
    link = group(lay, hw, "pp").link
    return 2 * p2p_time(msg, link), pipeline_loss_seconds(lay, link)


def _tiny_layout() -> Any:
    from plait.plan.layout import Layout

    return Layout(pp=2, micro_batch=TINY_PP_BATCH, microbatches=TINY_PP_MICRO)


def action_overhead(
    pipeline_s: float, plain_s: float, per_mb_s: float, loss_s: float, clock: str
) -> float:
    """The fixed cost ``x`` of one compute action from one rank's tiny step (module
    doc): ``((t_pipeline - t_loss)/n - t_plain/m - c) / 2``, at least 0."""
    m = TINY_PP_MICRO
    n = m + (1 if clock == "wall" else 0)  # p - 1 = 1 bubble slot on the wall clock
    return max(0.0, ((pipeline_s - loss_s) / n - plain_s / m - per_mb_s) / 2)


def pipeline_overhead(hw: Hardware, ranks: list[dict[str, dict[str, float]]], clock: str) -> float:
    """The profile's ``pp_action_overhead_s``: the largest per-rank
    :func:`action_overhead` of the ranks' :func:`measure_pipeline` results."""
    per_mb, loss = pipeline_comm_charge(hw)
    return max(
        action_overhead(r[clock]["pipeline"], r[clock]["plain"], per_mb, loss, clock) for r in ranks
    )
