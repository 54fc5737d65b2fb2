"""The pipeline schedule's cost per compute action, measured on two small pipelines.

A pipeline rank runs, per micro-batch, a forward and a backward action of each of its
pieces; each pays, beyond its piece's own work, the schedule's Python, one autograd
backward call per action, the detach / ``requires_grad`` of its messages and a receive
buffer, and the hand-off of its messages, which costs more the more work came before
it (on CPU ranks the transport's threads wake and copy on the cores the work just
used: per micro-batch 0.3-0.7 ms of CPU time beyond the pieces at 0.6 ms of work,
1.1-1.6 ms at 6 ms, 2.0-2.6 ms at 11 ms, on the first stage of two). :func:`measure_pipeline`
times, on pairs of ranks and on both clocks,
:func:`plait.parallel.pipeline.runtime.pipeline_step` (1F1B, :data:`TINY_PP_MICRO`
micro-batches, two stages of one block each) and, in alternation (so that a change of
background load hits both alike), the same rank's piece run plainly on the same
micro-batches (forward and backward, no messages), for two models: a tiny one
(:data:`TINY_BLOCK`, :data:`TINY_PP_BATCH` sequence per micro-batch) and one with work
(:data:`WORK_PP_MODEL`, :data:`WORK_PP_BATCH` sequences). Per pipeline ``i`` the extra
seconds per micro-batch are solved from the planner's pipeline time::

    y_i = (t_pipeline - t_loss)/n - t_plain/m - c,   n = m (+ p - 1 on the wall clock)
    y_i = 2·x + k·W_i,   W_i = t_plain/m (the piece's work per micro-batch)

with ``c`` the planner's two messages per micro-batch and ``t_loss`` its loss
broadcast (:mod:`plait.plan.overheads`): differences of two measurements on the same
rank, so the compute rates (and their noise) drop out. :func:`pipeline_overhead`
solves the two pipelines of the slowest rank for the fixed cost ``x`` per action
(``pp_action_overhead_s``) and the cost ``k`` per second of work
(``pp_action_per_work``); with only the tiny pipeline (quick), ``k = 0``.
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
WORK_PP_MODEL = {"dim": 128, "n_heads": 4, "max_seq_len": 128}
"""The block of the pipeline with work (one per stage): about 11 ms of forward and
backward per micro-batch of :data:`WORK_PP_BATCH` sequences on one CPU core, the upper
end of small CPU models' stages, so that smaller stages are interpolated."""
WORK_PP_BATCH = 4
"""Sequences per micro-batch of the pipeline with work."""
KINDS = {"": (TINY_BLOCK, TINY_PP_BATCH), "_work": (WORK_PP_MODEL, WORK_PP_BATCH)}
"""Result key suffix -> (block, sequences per micro-batch) of each pipeline."""


def _tiny_config(kind: str = "") -> Any:
    from plait.config import ModelConfig

    t = KINDS[kind][0]
    return ModelConfig(
        n_layers=TINY_PP_LAYERS,
        vocab_size=256,
        dim=t["dim"],
        n_heads=t["n_heads"],
        max_seq_len=t["max_seq_len"],
    )


def measure_pipeline(mesh: Any, reps: int, work: bool = True) -> dict[str, dict[str, float]]:
    """Seconds of one 1F1B pipeline step (forward, backward, loss broadcast) over the pp
    axis of ``mesh`` (2 stages) and of this rank's piece run plainly on the same
    micro-batches, per clock (medians of ``reps``, alternated): keys ``pipeline`` and
    ``plain`` for the tiny pipeline and, when ``work``, ``pipeline_work`` and
    ``plain_work`` for the pipeline with work."""
    out: dict[str, dict[str, float]] = {c: {} for c in CLOCKS}
    for kind in ("", "_work") if work else ("",):
        got = _measure_one(mesh, reps, kind)
        for c in CLOCKS:
            out[c].update({k + kind: v for k, v in got[c].items()})
    return out


def _measure_one(mesh: Any, reps: int, kind: str) -> dict[str, dict[str, float]]:
    import torch
    import torch.nn.functional as F

    from plait import comm
    from plait.model.transformer import Transformer
    from plait.parallel.pipeline.runtime import PipelineRuntime, pipeline_step
    from plait.parallel.pipeline.schedules import build_schedule
    from plait.parallel.pipeline.split import split_transformer

    cfg = _tiny_config(kind)
    s, m, b = cfg.max_seq_len, TINY_PP_MICRO, KINDS[kind][1]
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


def pipeline_comm_charge(hw: Hardware, kind: str = "") -> tuple[float, float]:
    """(per micro-batch, per step) seconds the planner charges the pipeline ``kind``
    (:data:`KINDS`) for its two messages per micro-batch and for its loss broadcast."""
    from plait.plan.layout import PRECISIONS
    from plait.plan.network import group, p2p_time
    from plait.plan.overheads import pipeline_loss_seconds

    cfg = _tiny_config(kind)
    lay = _tiny_layout(kind)
    msg = KINDS[kind][1] * cfg.max_seq_len * cfg.dim * PRECISIONS["fp32"].activation_bytes
    link = group(lay, hw, "pp").link
    return 2 * p2p_time(msg, link), pipeline_loss_seconds(lay, link)


def _tiny_layout(kind: str = "") -> Any:
    from plait.plan.layout import Layout

    return Layout(pp=2, micro_batch=KINDS[kind][1], microbatches=TINY_PP_MICRO)


def extra_per_microbatch(
    pipeline_s: float, plain_s: float, per_mb_s: float, loss_s: float, clock: str
) -> float:
    """One rank's extra seconds per micro-batch beyond its piece's work, messages and
    loss broadcast (module doc): ``(t_pipeline - t_loss)/n - t_plain/m - c``."""
    m = TINY_PP_MICRO
    n = m + (1 if clock == "wall" else 0)  # p - 1 = 1 bubble slot on the wall clock
    return (pipeline_s - loss_s) / n - plain_s / m - per_mb_s


def solve_action_costs(
    tiny: tuple[float, float], work: tuple[float, float] | None
) -> tuple[float, float]:
    """``(x, k)`` from ``(W, y)`` of the tiny pipeline and of the one with work
    (``y = 2·x + k·W``), both at least 0; ``k = 0`` without the second pipeline."""
    w0, y0 = tiny
    if work is None or work[0] <= w0:
        return max(0.0, y0 / 2), 0.0
    w1, y1 = work
    k = max(0.0, (y1 - y0) / (w1 - w0))
    x = (y0 - k * w0) / 2
    if x < 0:  # the line through both crosses below zero: keep x = 0, fit k to the work
        return 0.0, max(0.0, y1 / w1)
    return x, k


def pipeline_overhead(
    hw: Hardware, ranks: list[dict[str, dict[str, float]]], clock: str
) -> tuple[float, float]:
    """The profile's ``(pp_action_overhead_s, pp_action_per_work)`` from the ranks'
    :func:`measure_pipeline` results: each pipeline's ``(W, y)`` of the rank with the
    largest ``y`` (a step is done when its slowest rank is), solved by
    :func:`solve_action_costs`."""
    m = TINY_PP_MICRO

    def point(kind: str) -> tuple[float, float] | None:
        if not all(f"pipeline{kind}" in r[clock] for r in ranks):
            return None
        per_mb, loss = pipeline_comm_charge(hw, kind)
        pts = [
            (r[clock][f"plain{kind}"] / m,
             extra_per_microbatch(r[clock][f"pipeline{kind}"], r[clock][f"plain{kind}"],
                                  per_mb, loss, clock))
            for r in ranks
        ]  # fmt: skip
        return max(pts, key=lambda wy: wy[1])

    tiny = point("")
    assert tiny is not None, "every rank measures the tiny pipeline"
    return solve_action_costs(tiny, point("_work"))
