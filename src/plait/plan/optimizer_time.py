"""Seconds the optimizer step costs beyond AdamW's element-wise pass (Muon's Newton-Schulz
at the owners and its exchanges, Adafactor's all-reduces; see :mod:`plait.plan.optimizer`)."""

from __future__ import annotations

import heapq

from plait.arch.arithmetic import newton_schulz_flops
from plait.plan.hardware import Hardware
from plait.plan.layout import Layout
from plait.plan.modelspec import ModelSpec
from plait.plan.network import all_gather_time, all_reduce_time, all_to_all_time, group
from plait.plan.optimizer import MASTER_BYTES, OptimizerSpec, StageShape, block_matrices


def busiest_owner_seconds(seconds: list[float], ranks: int) -> float:
    """The most loaded of ``ranks`` owners when items costing ``seconds`` are dealt
    largest first to the least-loaded rank (the runtime's rule)."""
    if not seconds:
        return 0.0
    load = [0.0] * max(1, min(ranks, len(seconds)))
    heapq.heapify(load)
    for s in sorted(seconds, reverse=True):
        heapq.heappush(load, heapq.heappop(load) + s)
    return max(load)


def extra_seconds(
    spec: ModelSpec, opt: OptimizerSpec, layout: Layout, hw: Hardware, stage: StageShape
) -> float:
    """Seconds one rank of ``stage`` spends in the optimizer step beyond AdamW's
    element-wise pass (see the module docstring)."""
    if opt.name == "adamw" or stage.layers == 0:
        return 0.0
    f = layout.shard_factor if layout.zero >= 1 else 1
    shard = group(layout, hw, "dp", size=f) if f > 1 else None
    tp = group(layout, hw, "tp") if layout.tp > 1 else None
    mats = [m for m in block_matrices(spec) for _ in range(stage.layers)]
    if opt.name == "adafactor":  # two all-reduces: the sums, then the update's norm
        elements = sum(o + i + 2 for o, i in mats) + 2 * stage.tensors
        out = 0.0
        for g in (shard, tp):
            if g is not None:
                out += all_reduce_time(elements * MASTER_BYTES, g.size, g.link)
        return out
    flops = [newton_schulz_flops(m, opt.ns_steps) for m in mats]
    sizes = [(min(m) ** 2 * max(m)) ** (1 / 3) for m in mats]  # the Gram GEMM's size
    seconds = [fl / hw.matmul.at(s) for fl, s in zip(flops, sizes, strict=True)]
    out = busiest_owner_seconds(seconds, f)
    elements = sum(o * i for o, i in mats)
    if shard is not None:  # two all-to-alls of a shard each: momentum pieces in, updates out
        held = elements / layout.tp * MASTER_BYTES / f
        out += 2 * all_to_all_time(held, shard.size, shard.link)
    if tp is not None:  # each matrix's update gathered whole over tp
        out += all_gather_time(elements * MASTER_BYTES, tp.size, tp.link)
    return out
