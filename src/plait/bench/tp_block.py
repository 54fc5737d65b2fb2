"""The tensor-parallel block grid: plait's block sharded over tp = 2, timed whole on
pairs of ranks, against what the planner charges for it (``Hardware.tp_block_scale``,
``Hardware.sp_block_scale``).

Why a measurement of its own. A block split over two ranks is not the tp = 1 block at
half the work plus some collectives priced alone:

* its compute composes differently (narrower GEMMs, the region functions' autograd
  nodes, the hidden-state copies they make): measured with the collectives replaced by
  local copies, 3-16 % above the tp = 1 grid's ratio (up to 36 % with sequence
  parallelism at the smallest shape);
* a collective issued between compute costs more the more work precedes it (on two
  cores: 0.6-1 ms of CPU time after 0.3 ms of work, 2.7-3 ms after 8.5 ms), and less
  when more ranks than cores share the machine (0.2-1 ms with four ranks), yet a
  four-rank block measured 1.1-1.5x its charge: the in-step all-reduce measured at one
  fixed amount of work (:func:`plait.bench.calibrate.measure_in_step`) does not carry
  over to a block.

So the block itself is measured: a stack of :data:`~plait.bench.measure.BLOCK_GRID_DEPTH`
of plait's :class:`~plait.model.transformer.Block` sharded by plait's own tensor-parallel
plan over the pool's tp pairs (every pair at once, as a step runs them), in training,
with and without sequence parallelism, on the tp = 1 grid's shapes. The ratio per shape
is the measured time over the planner's unscaled charge (compute at tp = 2 plus the
block's in-step collectives, :func:`plait.plan.tp_comm.tp_comm_time`); the planner then
charges a tp-2 block, compute and collectives, that ratio
(:func:`plait.plan.overheads.tp_block_ratio`), interpolated like ``block_scale``.

Like :mod:`plait.bench.measure`, this module imports torch only inside its functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from plait.bench.measure import (
    BLOCK_GRID_BATCHES,
    BLOCK_GRID_DEPTH,
    BLOCK_GRID_DIMS,
    BLOCK_GRID_SEQ,
    CLOCKS,
    _median_times,
    block_grid_config,
)
from plait.plan.hardware import TP_GRID_DEGREE, Hardware

GRID_KEYS = {False: "tp_block_scale", True: "sp_block_scale"}
"""The profile field of each grid, by sequence parallelism."""

Grid = list[tuple[float, float, float]]
"""``(hidden, tokens, seconds)`` per measured block, or ``(hidden, tokens, ratio)``."""


def block_stack_plan() -> list[tuple[str, Any]]:
    """The block entries of plait's tensor-parallel plan (no embedding or head)."""
    from plait.parallel.tensor.sharding_plan import TRANSFORMER_TP_PLAN

    return [e for e in TRANSFORMER_TP_PLAN if e[0].startswith("layers.")]


def measure_tp_block_grid(
    mesh: Any,
    sequence_parallel: bool,
    reps: int,
    dims: Sequence[int] = BLOCK_GRID_DIMS,
    batches: Sequence[int] = BLOCK_GRID_BATCHES,
) -> dict[str, Grid]:
    """Per clock, ``(hidden, tokens, seconds)`` of one tensor-parallel block's forward +
    backward in training over ``mesh``'s tp axis (of size :data:`TP_GRID_DEGREE`), for
    each hidden size x batch: the stack's median time over ``reps`` (after a warm-up),
    every gradient set to None before each step, divided by the depth. Every rank of
    ``mesh`` must call it with the same arguments (the blocks' collectives pair them)."""
    import torch
    from torch import nn

    from plait import comm
    from plait.model.transformer import Block
    from plait.parallel.tensor.sharding_plan import apply_tensor_parallel

    tp = mesh.axis("tp")
    if tp.size != TP_GRID_DEGREE:
        raise ValueError(f"the tp block grid is measured at tp = {TP_GRID_DEGREE}, got {tp.size}")
    per_clock: dict[str, Grid] = {c: [] for c in CLOCKS}
    for dim in dims:
        cfg = block_grid_config(dim)
        stack = nn.Module()
        stack.layers = nn.ModuleList(Block(cfg, i) for i in range(BLOCK_GRID_DEPTH))
        for p in stack.parameters():
            nn.init.normal_(p, std=0.02)
        apply_tensor_parallel(stack, mesh, sequence_parallel, block_stack_plan())
        params = list(stack.parameters())
        s, half = BLOCK_GRID_SEQ, cfg.head_dim // 2
        rope = (torch.rand(s, half), torch.rand(s, half))
        local = s // tp.size if sequence_parallel else s  # SP: this rank's sequence shard
        for batch in batches:
            x = torch.randn(batch, local, dim, requires_grad=True)  # (batch, seq, hidden)
            g = torch.randn(batch, local, dim)

            def step(
                x: Any = x, g: Any = g, params: Any = params, rope: Any = rope, m: Any = stack
            ) -> None:
                for p in (*params, x):
                    p.grad = None
                h = x
                for b in m.layers:
                    h = b(h, *rope)
                h.backward(g)

            comm.barrier(tp)
            t = _median_times(step, reps)
            for c in CLOCKS:
                per_clock[c].append((float(dim), float(batch * s), t[c] / BLOCK_GRID_DEPTH))
    return per_clock


def tp_block_body(mesh: Any, quick: bool) -> dict[str, Any]:
    """Both grids on one rank of the pool (wall clock; CPU time under ``"cpu"``), keyed
    by their profile fields."""
    dims = BLOCK_GRID_DIMS[:1] if quick else BLOCK_GRID_DIMS
    batches = BLOCK_GRID_BATCHES[:1] if quick else BLOCK_GRID_BATCHES
    reps = 2 if quick else 9  # four ranks on two cores: a block varies +-8 % rep to rep
    res = {
        key: measure_tp_block_grid(mesh, sp, reps, dims, batches) for sp, key in GRID_KEYS.items()
    }
    return {
        **{key: r["wall"] for key, r in res.items()},
        "cpu": {key: r["cpu"] for key, r in res.items()},
    }


def grid_body(ctx: Any, quick: bool) -> dict[str, Any]:
    """:func:`tp_block_body` on the pool's tp pairs (a :class:`~plait.testing.WorkerPool`
    body; an empty result on one rank or an odd world)."""
    w = ctx.world_size
    if w < 2 or w % 2:
        return {"cpu": {}}
    return tp_block_body(ctx.mesh(dp=w // 2, tp=TP_GRID_DEGREE), quick)


def mean_grids(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One rank's :func:`tp_block_body` results of several runs (say before and after a
    benchmark's steps) as one: each point's mean seconds, on both clocks."""
    out: dict[str, Any] = {"cpu": {}}
    for part_of in (lambda r: r, lambda r: r["cpu"]):
        first, dest = part_of(runs[0]), part_of(out)
        for key in GRID_KEYS.values():
            if all(part_of(r).get(key) for r in runs):
                dest[key] = [
                    (d, t, sum(part_of(r)[key][i][2] for r in runs) / len(runs))
                    for i, (d, t, _) in enumerate(first[key])
                ]
    return out


def tp_block_grid_charge(hw: Hardware, dim: float, tokens: float, sequence_parallel: bool) -> float:
    """Seconds the planner charges one tensor-parallel grid block (hidden ``dim``,
    ``tokens`` per micro-batch, tp = :data:`TP_GRID_DEGREE`), forward + backward, compute
    and in-step collectives, with ``hw``'s rates, fixed costs and grids."""
    from plait.plan.compute import block_time
    from plait.plan.layout import PRECISIONS, Layout, Runtime
    from plait.plan.modelspec import ModelSpec
    from plait.plan.query import Query
    from plait.plan.tp_comm import tp_comm_time

    spec = ModelSpec.from_config(block_grid_config(int(dim)), "tp-block-grid")
    lay = Layout(
        tp=TP_GRID_DEGREE,
        micro_batch=max(1, round(tokens / BLOCK_GRID_SEQ)),
        sequence_parallel=sequence_parallel,
    )
    q = Query.of_layout(spec, lay, hw, PRECISIONS["fp32"], Runtime(), BLOCK_GRID_SEQ)
    bt = block_time(q, lay)
    return bt.forward + bt.backward + tp_comm_time(q, lay).block


def tp_block_scale_points(
    hw: Hardware, measured: Sequence[tuple[float, float, float]], sequence_parallel: bool
) -> tuple[tuple[float, float, float], ...]:
    """``(hidden, tokens, measured / charged)`` for each measured tensor-parallel grid
    block, charged by ``hw`` without any grid (:func:`tp_block_grid_charge`)."""
    base = replace(hw, block_scale=(), tp_block_scale=(), sp_block_scale=())
    return tuple(
        (d, t, sec / tp_block_grid_charge(base, d, t, sequence_parallel)) for d, t, sec in measured
    )


def with_tp_grids(hw: Hardware, results: list[dict[str, Any]], clock: str) -> Hardware:
    """``hw`` with both tensor-parallel grids from every rank's :func:`tp_block_body`
    result on ``clock`` (each point the slowest rank's: a pair's block is done when its
    last rank is); ``hw`` unchanged when any rank has none."""
    parts = [r if clock == "wall" else r.get("cpu", {}) for r in results]
    for sp, key in GRID_KEYS.items():
        if not all(p.get(key) for p in parts):
            continue
        first = parts[0][key]
        slowest = [(d, t, max(p[key][i][2] for p in parts)) for i, (d, t, _) in enumerate(first)]
        points = tp_block_scale_points(hw, slowest, sp)
        hw = replace(hw, sp_block_scale=points) if sp else replace(hw, tp_block_scale=points)
    return hw


__all__ = [
    "GRID_KEYS",
    "block_stack_plan",
    "grid_body",
    "mean_grids",
    "measure_tp_block_grid",
    "tp_block_body",
    "tp_block_grid_charge",
    "tp_block_scale_points",
    "with_tp_grids",
]
