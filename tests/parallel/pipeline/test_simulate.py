"""The schedule simulator reproduces the textbook bubbles and memory bounds exactly.

Cost convention (see simulate.py): forward f and backward b are the costs of one
micro-batch through one rank's share of the model; an interleaved chunk costs 1/v of it;
communication is free unless stated. Under it the formulas are exact for b = 2f and for
b = f alike, and the tests check both.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from plait.errors import ConfigError
from plait.parallel.pipeline.actions import Op
from plait.parallel.pipeline.schedules import build_schedule
from plait.parallel.pipeline.simulate import Costs, simulate
from plait.parallel.pipeline.validate import ScheduleError

PS = (1, 2, 3, 4, 8)
MS = (1, 2, 4, 5, 8, 16)
CONVENTIONS = [Costs(forward=1, backward=2), Costs(forward=1, backward=1)]


@pytest.mark.parametrize("costs", CONVENTIONS, ids=["b=2f", "b=f"])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(
    name: str, costs: Costs
) -> None:
    for p in PS:
        for m in MS:
            r = simulate(build_schedule(name, p, m), costs)
            fb = Fraction(costs.forward) + Fraction(costs.backward)
            assert r.makespan == (m + p - 1) * fb, (p, m)
            assert r.bubble == Fraction(p - 1, m + p - 1), (p, m)
            assert set(r.idle) == {(p - 1) * fb}


@pytest.mark.parametrize("costs", CONVENTIONS, ids=["b=2f", "b=f"])
def test_interleaved_bubble_is_one_over_v_of_1f1b(costs: Costs) -> None:
    for p in (2, 3, 4):
        for m in (p, 2 * p, 4 * p):
            step_1f1b = simulate(build_schedule("1f1b", p, m), costs).makespan
            for v in (1, 2, 3, 4):
                r = simulate(build_schedule("interleaved", p, m, v), costs)
                # the textbook's (1/v)(p-1)/(m+p-1): idle time per rank over the
                # non-interleaved step
                for idle in r.idle:
                    assert idle / step_1f1b == Fraction(p - 1, m + p - 1) / v, (p, m, v)
                # ... and as a fraction of its own (shorter) step: (p-1)/(vm + p - 1)
                assert r.bubble == Fraction(p - 1, v * m + p - 1), (p, m, v)


def test_1f1b_holds_at_most_p_microbatches_gpipe_m() -> None:
    for p in PS:
        for m in MS:
            one = simulate(build_schedule("1f1b", p, m)).peak_inflight
            assert one[0] == min(p, m)
            assert one == tuple(min(p - r, m) for r in range(p))
            assert simulate(build_schedule("gpipe", p, m)).peak_inflight == (m,) * p


def test_zero_bubble_beats_1f1b() -> None:
    # F = I = W = 1 (B = I + W = 2): ZB-H1 idles p - 1 per rank instead of 3(p - 1)
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 3 * p + 1):
            zb = simulate(build_schedule("zb", p, m))
            one = simulate(build_schedule("1f1b", p, m))
            assert zb.bubble < one.bubble
            assert zb.makespan == 3 * m + p - 1
            assert zb.bubble == Fraction(p - 1, 3 * m + p - 1)
            assert max(zb.peak_inflight) <= p  # 1F1B's peak
    for m in (1, 2, 3):  # fewer micro-batches than stages: never worse than 1F1B
        assert simulate(build_schedule("zb", 4, m)).makespan <= simulate(
            build_schedule("1f1b", 4, m)
        ).makespan


def test_naive_idles_all_but_one_rank() -> None:
    for p in PS:
        assert simulate(build_schedule("naive", p, 3)).bubble == Fraction(p - 1, p)


def test_communication_latency_is_charged_per_batch() -> None:
    # naive p = 2: F0 | send  ..  recv | F0 B0 | send  ..  recv | B0 : two hops of c each
    c = Fraction(1, 10)
    r = simulate(build_schedule("naive", 2, 1), Costs(comm=c))
    assert r.makespan == 6 + 2 * c
    assert r.busy == (3, 3)
    assert simulate(build_schedule("1f1b", 4, 8), Costs(comm=c)).makespan > 33


def test_timeline_follows_each_rank_order_without_overlap() -> None:
    s = build_schedule("interleaved", 2, 4, 2)
    r = simulate(s, Costs(forward=Fraction(1, 3), backward=0.5))
    for rank, acts in enumerate(s.actions):
        evs = [e for e in r.timeline if e.rank == rank]
        assert [e.action for e in evs] == list(acts)
        for a, b in itertools.pairwise(evs):
            same_batch = a.action.op.is_comm and b.action.op.is_comm
            assert a.start <= a.end <= b.start or (same_batch and (a.start, a.end) == (
                b.start, b.end))
        for e in evs:
            if e.action.op.is_compute:
                full = Fraction(1, 3) if e.action.op.value == "F" else Fraction(1, 2)
                assert e.end - e.start == full / 2  # one chunk of two
    assert max(e.end for e in r.timeline) == r.makespan
    unscaled = simulate(s, Costs(per_chunk=False))
    assert sum(unscaled.busy) == 2 * sum(simulate(s).busy)


@pytest.mark.parametrize("costs", CONVENTIONS, ids=["b=2f", "b=f"])
def test_lockstep_placement_costs_nothing_except_for_interleaved(costs: Costs) -> None:
    for name, v in (("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2)):
        for p, m in ((2, 4), (4, 8), (4, 16)):
            adjacent = simulate(build_schedule(name, p, m, v), costs).makespan
            lock = build_schedule(name, p, m, v, placement="lockstep")
            buffered = simulate(lock, costs).makespan
            unbuffered = simulate(lock, costs, rendezvous=True).makespan
            if name != "interleaved" or costs.backward == costs.forward:
                assert buffered == unbuffered == adjacent, (name, p, m)
            else:  # blocking sends make interleaved ranks wait for each other
                assert adjacent < buffered <= unbuffered < Fraction(5, 4) * adjacent


def test_deadlock_and_bad_costs_are_reported() -> None:
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(build_schedule("interleaved", 2, 4, 2), rendezvous=True)
    with pytest.raises(ConfigError, match="cost forward must be >= 0, got -1"):
        Costs(forward=-1)


def test_measured_durations_replace_the_per_kind_costs() -> None:
    """A replay with each action's own duration: equal to the per-kind costs when the
    durations are those costs; one slow action on the last rank of 1F1B delays the step by
    exactly its extra time (the last rank is on the critical path)."""
    s = build_schedule("1f1b", 2, 4, 1)
    costs = Costs()
    same = [{a: float(costs.of(a.op, 1)) for a in acts if a.op.is_compute} for acts in s.actions]
    assert simulate(s, durations=same).makespan == simulate(s, costs).makespan
    slow = [dict(d) for d in same]
    first_b = next(a for a in s.actions[1] if a.op is Op.BACKWARD)
    slow[1][first_b] += 0.5
    assert simulate(s, durations=slow).makespan == simulate(s, costs).makespan + Fraction(1, 2)
