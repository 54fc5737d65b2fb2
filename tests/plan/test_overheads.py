"""Each step-time term of :mod:`plait.plan.overheads` against a hand computation."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from plait.parallel.context.layout import chunk_ids
from plait.plan.compute import block_time
from plait.plan.estimate import step_time
from plait.plan.hardware import IN_STEP, PRESETS, Curve, Hardware, Link
from plait.plan.layout import PRECISIONS, Layout, Runtime
from plait.plan.modelspec import ModelSpec
from plait.plan.overheads import (
    RING_BWD_OPS,
    RING_BWD_PASSES,
    RING_FWD_OPS,
    RING_FWD_PASSES,
    ZERO3_COPY_PASSES,
    ZERO3_UNIT_OPS,
    attention_length,
    block_scale,
    equivalent_all_reduce_bytes,
    in_step_time,
    ring_block_seconds,
    ring_pairs,
    zero3_unit_numels,
    zero3_unit_seconds,
)
from plait.plan.units import stage_units
from tests.plan.queries import query

FP32 = PRECISIONS["fp32"]
SPEC = ModelSpec("t", 4, 128, 4, 4, 352, 256, "llama", 128)
IN_STEP_CURVE = Curve(((512.0, 1e-3), (2.0**21, 4e-3)))


def _hw(in_step: bool = True, **kw: Any) -> Hardware:
    """A CPU-like profile with round numbers: barrier-separated collectives 1e-4 s +
    bytes/1e9, an in-step all-reduce curve on pairs."""
    measured = ((IN_STEP, 2, IN_STEP_CURVE),) if in_step else ()
    link = Link(1e-4, 1e9, (), measured)
    unit = Curve.constant(1e9)
    base = Hardware("cpu-test", 4e9, 1e10, unit, unit, unit, 1e9, 1e-6, 2, link, link)
    return dataclasses.replace(base, comm_overlap=0.0, **kw)


def test_equivalent_all_reduce_bytes() -> None:
    # an all-reduce of S over n ranks sends 2(n-1)/n·S per rank
    assert equivalent_all_reduce_bytes("all_reduce", 1000.0, 4) == pytest.approx(1000.0)
    # all-gather of a 1000-byte output on 2 ranks sends 500 bytes: an all-reduce of 500
    assert equivalent_all_reduce_bytes("all_gather", 1000.0, 2) == pytest.approx(500.0)
    assert equivalent_all_reduce_bytes("reduce_scatter", 800.0, 4) == pytest.approx(400.0)
    # an exchange of S bytes: an all-reduce of S on a pair
    assert equivalent_all_reduce_bytes("p2p", 1000.0, 2) == pytest.approx(1000.0)


def test_in_step_time_by_hand() -> None:
    hw = _hw()
    link = hw.intra
    # 8 bytes is below the smallest in-step point: its cost (1 ms) > 2·1e-4 + 8/1e9
    assert in_step_time("all_reduce", 8.0, 2, link) == pytest.approx(1e-3)
    # a 1 MiB all-gather on 2 ranks: 2**19 bytes per rank -> the curve at 2**19
    want = IN_STEP_CURVE.at(2.0**19)
    assert in_step_time("all_gather", 2.0**20, 2, link) == pytest.approx(want)
    # where the barrier-separated time is larger, it is kept: 100 MB over 1e9 B/s
    assert in_step_time("p2p", 1e8, 2, link) == pytest.approx(1e-4 + 1e8 / 1e9)
    # no in-step measurement (GPU presets): the op's own time
    plain = _hw(in_step=False).intra
    assert in_step_time("all_gather", 2.0**20, 2, plain) == pytest.approx(1e-4 + 2**19 / 1e9)
    assert in_step_time("all_reduce", 8.0, 1, link) == 0.0


def test_attention_length() -> None:
    assert attention_length(Layout(cp=2), 128) == 32.0  # two chunks of 32 per rank
    assert attention_length(Layout(cp=2, cp_attention="ulysses"), 128) == 128.0
    assert attention_length(Layout(), 128) == 128.0


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_pairs_counts_the_runtime_zigzag(cp: int) -> None:
    """The visible causal chunk pairs of plait's zigzag layout, counted per rank."""
    for me in range(cp):
        mine = chunk_ids("zigzag", cp, me)
        n = sum(b <= a for src in range(cp) for a in mine for b in chunk_ids("zigzag", cp, src))
        assert n == ring_pairs(cp)


def test_ring_block_seconds_by_hand() -> None:
    hw = _hw()
    lay = Layout(cp=2, micro_batch=8)
    fwd, bwd = ring_block_seconds(query(SPEC, lay, FP32, Runtime(), 128, hw), lay)
    chunk = 8 * 4 * 32 * 32 * 4  # b·h·c·d·4 bytes, c = 128/4
    assert fwd == pytest.approx(5 * (RING_FWD_PASSES * chunk / 1e9 + RING_FWD_OPS * 1e-6))
    assert bwd == pytest.approx(5 * (RING_BWD_PASSES * chunk / 1e9 + RING_BWD_OPS * 1e-6))
    assert ring_block_seconds(query(SPEC, Layout(), FP32, Runtime(), 128, hw), Layout()) == (
        0.0,
        0.0,
    )


def test_zero3_unit_seconds_by_hand() -> None:
    hw = _hw()
    got = zero3_unit_seconds([1e6, 2e6], 40, hw)
    want = ZERO3_COPY_PASSES * 3e6 / 1e9 + (2 * ZERO3_UNIT_OPS + 3 * 40) * 1e-6
    assert got == pytest.approx(want)


def test_block_overhead_is_charged_once_per_block() -> None:
    lay, rt = Layout(micro_batch=8), Runtime()
    a = block_time(query(SPEC, lay, FP32, rt, 128, _hw()), lay)
    b = block_time(query(SPEC, lay, FP32, rt, 128, _hw(block_overhead_s=3e-3)), lay)
    assert (b.forward + b.backward) - (a.forward + a.backward) == pytest.approx(3e-3)
    assert b.forward - a.forward == pytest.approx(1e-3)
    # four blocks and two micro-batches: 4 x 2 x 3 ms more in the step
    two = Layout(micro_batch=4, microbatches=2)
    ta = step_time(query(SPEC, two, FP32, rt, 128, _hw()), two).compute
    tb = step_time(query(SPEC, two, FP32, rt, 128, _hw(block_overhead_s=3e-3)), two).compute
    assert tb - ta == pytest.approx(4 * 2 * 3e-3)


GRID = ((64.0, 256.0, 1.2), (64.0, 2048.0, 0.9), (256.0, 256.0, 1.5), (256.0, 2048.0, 1.0))


def test_block_scale_by_hand() -> None:
    """Log-bilinear between the grid's four points, clamped outside; 1 without a grid."""
    hw = _hw(block_scale=GRID)
    for d, t, r in GRID:  # the grid points themselves
        assert block_scale(hw, d, t) == pytest.approx(r)
    # the centre in log space (hidden 128 = sqrt(64·256), tokens sqrt(256·2048)):
    # the geometric mean of the four ratios
    centre = (1.2 * 0.9 * 1.5 * 1.0) ** 0.25
    assert block_scale(hw, 128.0, (256 * 2048) ** 0.5) == pytest.approx(centre)
    # hidden 128, tokens 1024: w_d = 1/2, w_t = log(4)/log(8) = 2/3
    want = (1.2 ** (1 / 3) * 0.9 ** (2 / 3)) ** 0.5 * (1.5 ** (1 / 3) * 1.0 ** (2 / 3)) ** 0.5
    assert block_scale(hw, 128.0, 1024.0) == pytest.approx(want)
    # clamped: below the smallest hidden size and beyond the most tokens
    assert block_scale(hw, 16.0, 256.0) == pytest.approx(1.2)
    assert block_scale(hw, 64.0, 10**6) == pytest.approx(0.9)
    assert block_scale(_hw(), 128.0, 1024.0) == 1.0


def test_block_scale_multiplies_the_block() -> None:
    """The block's forward, backward and a full recomputation are charged the ratio at
    the block's hidden size and tokens per micro-batch and rank."""
    rt = Runtime()
    for lay in (Layout(micro_batch=8), Layout(micro_batch=8, recompute="full")):
        a = block_time(query(SPEC, lay, FP32, rt, 128, _hw(block_overhead_s=3e-3)), lay)
        b = block_time(
            query(SPEC, lay, FP32, rt, 128, _hw(block_overhead_s=3e-3, block_scale=GRID)), lay
        )
        r = block_scale(_hw(block_scale=GRID), 128.0, 1024.0)
        assert b.forward == pytest.approx(r * a.forward)
        assert b.backward == pytest.approx(r * a.backward)
        assert b.recompute == pytest.approx(r * a.recompute)
    # tensor parallelism keeps the hidden size; context parallelism halves the tokens
    cp = Layout(cp=2, micro_batch=8, cp_attention="ulysses")
    a = block_time(query(SPEC, cp, FP32, rt, 128, _hw()), cp)
    b = block_time(query(SPEC, cp, FP32, rt, 128, _hw(block_scale=GRID)), cp)
    assert b.forward / a.forward == pytest.approx(block_scale(_hw(block_scale=GRID), 128.0, 512.0))


def test_zero3_collectives_per_unit_in_step() -> None:
    """ZeRO-3 on 2 ranks: per micro-batch, each of the runtime's 7 units (the embedding,
    4 blocks, the head, the root with the final norm) is gathered twice and
    reduce-scattered once, each synchronous (no overlap on CPU)."""
    hw, rt = _hw(), Runtime()
    lay = Layout(dp=2, zero=3, micro_batch=8)
    t = step_time(query(SPEC, lay, FP32, rt, 128, hw), lay)
    from plait.plan.memory import stage_params

    sp = stage_params(SPEC, lay, 0)
    emb, block = 256 * 128, 128 + 4 * 128 * 128 + 128 + 3 * 128 * 352
    units = [emb, block, block, block, block, emb, 128]  # elements, all even (F = 2)
    assert sum(units) == sp.params
    assert zero3_unit_numels(SPEC, lay, sp.params) == pytest.approx(units)
    want = sum(
        2 * in_step_time("all_gather", 4 * u, 2, hw.intra)
        + in_step_time("reduce_scatter", 4 * u, 2, hw.intra)
        for u in units
    )
    assert t.dp_comm == pytest.approx(want)
    plain = step_time(
        query(SPEC, dataclasses.replace(lay, zero=0), FP32, rt, 128, hw),
        dataclasses.replace(lay, zero=0),
    )
    copies = zero3_unit_seconds([4.0 * u for u in units], sp.tensors, hw)
    assert t.other - plain.other == pytest.approx(copies)
    # a unit is padded to a multiple of the shard factor: 129 elements over F = 2 -> 130
    odd = ModelSpec("odd", 1, 129, 3, 3, 256, 7, "llama", 16)
    got = zero3_unit_numels(odd, Layout(dp=2, zero=3), 10**6)
    held = sum(sum(u) for u in stage_units(odd, 1, 1, 0))
    assert got[-1] == pytest.approx(130 * 10**6 / held)


def test_gpu_presets_unchanged_by_in_step_terms() -> None:
    """Without in-step measurements the in-step cost is the collective's own."""
    hw = PRESETS["h100-80gb"]
    from plait.plan.network import all_gather_time, all_reduce_time

    assert in_step_time("all_reduce", 2.0**20, 8, hw.intra) == all_reduce_time(2.0**20, 8, hw.intra)
    want = 7 * hw.intra.latency_s + 7 / 8 * 2**20 / hw.intra.bandwidth
    assert in_step_time("all_gather", 2.0**20, 8, hw.intra) == pytest.approx(want)
    assert all_gather_time(2.0**20, 8, hw.intra) == pytest.approx(want)


def test_pipeline_action_and_loss_terms_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """pp2, 4 micro-batches: every micro-batch pays 2·v actions of the profile's fixed
    cost (in t_mb, so in the bubble too), the step one loss broadcast over pp."""
    from plait.plan.overheads import pipeline_action_seconds, pipeline_loss_seconds

    x = 2e-4
    hw, hw0 = _hw(pp_action_overhead_s=x), _hw()
    lay = Layout(pp=2, micro_batch=2, microbatches=4)
    assert pipeline_action_seconds(lay, hw) == pytest.approx(2 * x)
    inter = Layout(pp=2, micro_batch=2, microbatches=4, schedule="interleaved", chunks=2)
    assert pipeline_action_seconds(inter, hw) == pytest.approx(4 * x)
    assert pipeline_action_seconds(Layout(), hw) == 0.0
    # 8 bytes over the pair: below the in-step curve's first point, its 1 ms
    assert pipeline_loss_seconds(lay, hw.intra) == pytest.approx(1e-3)
    assert pipeline_loss_seconds(Layout(), hw.intra) == 0.0
    rt = Runtime()
    t, t0 = (
        step_time(query(SPEC, lay, FP32, rt, 128, hw), lay),
        step_time(query(SPEC, lay, FP32, rt, 128, hw0), lay),
    )
    assert t.pp_comm - t0.pp_comm == pytest.approx(4 * 2 * x)  # m·2·x
    assert t.bubble - t0.bubble == pytest.approx(1 * 2 * x)  # (p-1)·2·x
    assert t.compute == t0.compute and t.other == t0.other
    # the loss broadcast is in `other`: 1 ms more than without it
    import sys

    est = sys.modules["plait.plan.estimate"]  # the module (plait.plan.estimate is a function)
    monkeypatch.setattr(est, "pipeline_loss_seconds", lambda layout, link: 0.0)
    without = step_time(query(SPEC, lay, FP32, rt, 128, hw0), lay)
    assert t0.other - without.other == pytest.approx(1e-3)
    # GPU presets: no action cost
    assert pipeline_action_seconds(lay, PRESETS["h100-80gb"]) == 0.0


def test_tp_block_ratio_applies_at_the_calibrated_degree() -> None:
    """The tensor-parallel grid is read like ``block_scale`` (log-bilinear, clamped), the
    sequence-parallel grid under sequence parallelism, only at tp = 2 and only when the
    profile has the grid."""
    from plait.plan.overheads import grid_ratio, tp_block_ratio

    sp_grid = tuple((d, t, 2 * r) for d, t, r in GRID)
    hw = _hw(block_scale=((64.0, 256.0, 3.0),), tp_block_scale=GRID, sp_block_scale=sp_grid)
    want = (1.2 ** (1 / 3) * 0.9 ** (2 / 3)) ** 0.5 * (1.5 ** (1 / 3) * 1.0 ** (2 / 3)) ** 0.5
    assert grid_ratio(GRID, 128.0, 1024.0) == pytest.approx(want)
    assert tp_block_ratio(hw, Layout(tp=2), 128.0, 1024.0) == pytest.approx(want)
    sp = Layout(tp=2, sequence_parallel=True)
    assert tp_block_ratio(hw, sp, 128.0, 1024.0) == pytest.approx(2 * want)
    assert tp_block_ratio(hw, sp, 16.0, 256.0) == pytest.approx(2.4)  # clamped
    for lay in (Layout(), Layout(tp=4)):  # another degree: block_scale and in-step costs
        assert tp_block_ratio(hw, lay, 128.0, 1024.0) is None
    assert tp_block_ratio(_hw(tp_block_scale=GRID), sp, 128.0, 1024.0) is None
    assert grid_ratio((), 128.0, 1024.0) == 1.0


def test_tp_block_ratio_multiplies_block_compute_and_collectives() -> None:
    """At tp = 2 the grid's ratio replaces ``block_scale`` on the block's compute and
    multiplies its tensor-parallel collectives (4 in-step all-reduces per block, 8
    halves and 2 gain sums with sequence parallelism); the edges' collectives keep their
    in-step cost."""
    from plait.plan.network import in_step_all_reduce_time
    from plait.plan.tp_comm import tp_comm_time

    rt = Runtime()
    const = tuple((d, t, 1.5) for d, t, _ in GRID)
    for sp in (False, True):
        lay = Layout(tp=2, micro_batch=8, sequence_parallel=sp)
        plain = _hw(block_scale=GRID)  # a tp-1 ratio that must not apply
        grid = _hw(block_scale=GRID, tp_block_scale=const, sp_block_scale=const)
        none = _hw()
        a = block_time(query(SPEC, lay, FP32, rt, 128, none), lay)
        b = block_time(query(SPEC, lay, FP32, rt, 128, grid), lay)
        assert b.forward == pytest.approx(1.5 * a.forward)
        assert b.backward == pytest.approx(1.5 * a.backward)
        assert block_time(query(SPEC, lay, FP32, rt, 128, plain), lay).forward == pytest.approx(
            block_scale(plain, 128.0, 1024.0) * a.forward
        )
        link = none.intra
        msg = 8 * 128 * 128 * 4.0  # (b, s, h) fp32
        if sp:
            block = 8 * in_step_all_reduce_time(msg / 2, 2, link) + 2 * (
                in_step_all_reduce_time(128 * 4.0, 2, link)
            )
            edge = 2 * in_step_all_reduce_time(msg / 2, 2, link)
        else:
            block = 4 * in_step_all_reduce_time(msg, 2, link)
            edge = in_step_all_reduce_time(msg, 2, link)
        c0 = tp_comm_time(query(SPEC, lay, FP32, Runtime(), 128, none), lay)
        c1 = tp_comm_time(query(SPEC, lay, FP32, Runtime(), 128, grid), lay)
        assert c0.block == pytest.approx(block) and c1.block == pytest.approx(1.5 * block)
        assert c0.edge == c1.edge == pytest.approx(edge)
        t0 = step_time(query(SPEC, lay, FP32, rt, 128, none), lay)
        t1 = step_time(query(SPEC, lay, FP32, rt, 128, grid), lay)
        assert t1.tp_comm - t0.tp_comm == pytest.approx(4 * 0.5 * block)
        assert t1.compute - t0.compute == pytest.approx(4 * 0.5 * (a.forward + a.backward))


def test_pipeline_cost_per_second_of_work_by_hand() -> None:
    """``pp_action_per_work`` = k: each micro-batch pays k x the stage's compute for it
    (in t_mb, so the bubble too), on top of 2·v·x."""
    from plait.plan.overheads import pipeline_action_seconds

    x, k = 2e-4, 0.1
    lay = Layout(pp=2, micro_batch=2, microbatches=4)
    hw = _hw(pp_action_overhead_s=x, pp_action_per_work=k)
    assert pipeline_action_seconds(lay, hw, 5e-3) == pytest.approx(2 * x + k * 5e-3)
    assert pipeline_action_seconds(Layout(), hw, 5e-3) == 0.0
    rt = Runtime()
    t = step_time(query(SPEC, lay, FP32, rt, 128, hw), lay)
    t0 = step_time(query(SPEC, lay, FP32, rt, 128, _hw(pp_action_overhead_s=x)), lay)
    # the slowest stage's compute per micro-batch (forward + backward, both stages have
    # 2 blocks; the last adds the head, the larger edge here)
    blk = block_time(query(SPEC, lay, FP32, rt, 128, hw), lay)
    from plait.plan.compute import edge_time

    edge = edge_time(query(SPEC, lay, FP32, rt, 128, hw), lay)
    work = 2 * (blk.forward + blk.backward) + edge.head_forward + edge.head_backward
    assert t.pp_comm - t0.pp_comm == pytest.approx(4 * k * work)
    assert t.bubble - t0.bubble == pytest.approx(k * work)
    with pytest.raises(Exception, match="pp_action_per_work must be >= 0"):
        _hw(pp_action_per_work=-1.0)
