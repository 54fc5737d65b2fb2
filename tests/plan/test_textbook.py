"""The textbook numbers every planner must reproduce (ZeRO paper, GPipe/1F1B, docs/planner.md)."""

from __future__ import annotations

import dataclasses

import pytest

from plait.comm.stats import bus_bytes
from plait.plan.estimate import step_time
from plait.plan.hardware import Curve, Hardware, Link
from plait.plan.layout import PRECISIONS, RUNTIMES, Layout
from plait.plan.memory import (
    max_params_replicated,
    memory_per_rank,
    state_bytes,
    state_bytes_per_param,
)
from plait.plan.modelspec import MODEL_SPECS, ModelSpec
from plait.plan.network import all_reduce_time, ring_bytes_per_rank
from tests.plan.queries import query

MIXED = PRECISIONS["bf16-mixed"]


def test_mixed_precision_adam_is_16_bytes_per_parameter() -> None:
    assert MIXED.state_bytes_per_param == 16
    assert state_bytes_per_param(Layout(dp=64), MIXED) == 16
    # the fp32 runtime on CPU is 16 too: 4 (weights) + 4 (grads) + 8 (Adam m, v)
    assert PRECISIONS["fp32"].state_bytes_per_param == 16


def test_about_five_billion_parameters_fit_80_gb_replicated() -> None:
    assert max_params_replicated(80e9, MIXED) == pytest.approx(5.0e9)
    # and the state of a 5.0B model is 80 GB on one rank with dp=8 and no ZeRO
    w, g, m, o = state_bytes(5_000_000_000, 0, Layout(dp=8), MIXED)
    assert w + g + m + o == pytest.approx(80e9)


@pytest.mark.parametrize(
    ("zero", "expected"), [(0, 16.0), (1, 4 + 12 / 64), (2, 2 + 14 / 64), (3, 16 / 64)]
)
def test_zero_bytes_per_parameter_at_n_64(zero: int, expected: float) -> None:
    per_param = state_bytes_per_param(Layout(dp=64, zero=zero), MIXED)
    assert per_param == pytest.approx(expected)
    # the textbook roundings
    assert round(per_param, 2) == {0: 16.0, 1: 4.19, 2: 2.22, 3: 0.25}[zero]
    # the per-rank model agrees for a real parameter count (ceil-sharded, no scalars)
    n = 7_000_000_000
    w, g, m, o = state_bytes(n, 0, Layout(dp=64, zero=zero), MIXED)
    assert (w + g + m + o) / n == pytest.approx(expected, rel=1e-8)


def test_hybrid_factor_between_replicated_and_fully_sharded() -> None:
    full = state_bytes_per_param(Layout(dp=64, zero=3), MIXED)
    hybrid = state_bytes_per_param(Layout(dp=64, zero=3, zero_shard_size=8), MIXED)
    plain = state_bytes_per_param(Layout(dp=64, zero=3, zero_shard_size=1), MIXED)
    assert (full, hybrid, plain) == (0.25, 2.0, 16.0)


def test_seven_billion_parameters_need_about_112_gb_of_state() -> None:
    spec = ModelSpec.from_params(7e9)
    assert spec.param_count() == pytest.approx(7e9, rel=0.05)
    w, g, m, o = state_bytes(7_000_000_000, 0, Layout(), MIXED)
    assert w + g + m + o == pytest.approx(112e9)
    # the Llama 2 7B preset (6.74 B) on one rank
    mem = memory_per_rank(
        query(MODEL_SPECS["llama2-7b"], Layout(), MIXED, RUNTIMES["plait"], 4096), Layout()
    )
    assert mem.state == pytest.approx(16 * 6_738_415_616, rel=1e-6)


def _uniform_hardware() -> Hardware:
    c = Curve.constant(1e12)
    link = Link(0.0, 1e12)
    return Hardware("uniform", 1e12, 1e12, c, c, c, 1e12, 0.0, 8, link, link)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_bubble_is_3_over_35_for_p4_m32(schedule: str) -> None:
    spec = MODEL_SPECS["gpt2-355m"]  # 24 layers: 6 per stage
    lay = Layout(pp=4, micro_batch=1, microbatches=32, schedule=schedule)  # type: ignore[arg-type]
    t = step_time(query(spec, lay, MIXED, RUNTIMES["megatron"], 1024, _uniform_hardware()), lay)
    pipeline = t.compute + t.recompute + t.tp_comm + t.cp_comm + t.pp_comm + t.bubble
    assert t.bubble / pipeline == pytest.approx(3 / 35)


def test_interleaving_divides_the_bubble_by_v() -> None:
    spec = MODEL_SPECS["gpt2-355m"]
    base = Layout(pp=4, micro_batch=1, microbatches=32)
    inter = dataclasses.replace(base, schedule="interleaved", chunks=2)
    hw, rt = _uniform_hardware(), RUNTIMES["megatron"]
    b1 = step_time(query(spec, base, MIXED, rt, 1024, hw), base)
    b2 = step_time(query(spec, inter, MIXED, rt, 1024, hw), inter)
    per_mb_1 = b1.bubble / 3
    per_mb_2 = b2.bubble / (3 / 2)
    assert per_mb_2 == pytest.approx(per_mb_1, rel=0.05)  # only the p2p count differs
    assert b2.bubble < b1.bubble


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_ring_all_reduce_sends_2_n_minus_1_over_n_s_per_rank(n: int) -> None:
    s = 123_456_789.0
    assert ring_bytes_per_rank(s, n) == pytest.approx(2 * (n - 1) / n * s)
    assert ring_bytes_per_rank(s, n) == pytest.approx(bus_bytes("all_reduce", int(s), n))
    bw = 1e9
    t = all_reduce_time(s, n, Link(0.0, bw), "ring")
    assert t == pytest.approx(2 * (n - 1) / n * s / bw)
    alpha = 1e-5
    t_alpha = all_reduce_time(s, n, Link(alpha, bw), "ring")
    assert t_alpha - t == pytest.approx(2 * (n - 1) * alpha)
