"""Replanning an elastic run for its survivors (pure logic, no ranks): the largest world
whose allowed layout divides the global batch, gradient accumulation making up the
batch, and refusals that name what would work."""

from __future__ import annotations

import pytest

from plait.errors import ConfigError
from plait.plan.replan import allowed_layouts, check_elastic, micro_for, replan

DP4 = {"dp": 4, "tp": 1, "pp": 1, "cp": 1}
TP2DP2 = {"dp": 2, "tp": 2, "pp": 1, "cp": 1}


def test_one_rank_of_dp4_lost() -> None:
    r = replan(12, 3, 2, DP4, micro_batch=3)  # 12 on 3: 4 each, micro 3 -> 2, 2 micro-steps
    assert (r.world, r.name, r.micro_batch, r.accumulation) == (3, "dp3", 2, 2)
    r = replan(16, 3, 2, DP4, micro_batch=4)  # 16 is not divisible by 3: two ranks
    assert (r.world, r.name, r.micro_batch, r.accumulation) == (2, "dp2", 4, 2)
    assert r.overrides() == [
        "launch.nproc=2", "parallel.dp=2", "parallel.tp=1", "parallel.pp=1", "parallel.cp=1",
        "train.micro_batch=4",
    ]  # fmt: skip


def test_model_parallel_degrees_kept_without_a_policy() -> None:
    r = replan(12, 3, 2, TP2DP2, micro_batch=6)  # 3 ranks: no multiple of tp2 -> 2
    assert (r.world, r.name, r.micro_batch, r.accumulation) == (2, "tp2xdp1", 6, 2)
    assert allowed_layouts((), TP2DP2, 3) == []


def test_a_policy_lists_the_allowed_layouts() -> None:
    policy = ("tp2xdp2", "dp3", "dp2")
    assert replan(12, 3, 2, TP2DP2, 6, policy).name == "dp3"
    assert replan(16, 3, 2, TP2DP2, 8, policy).name == "dp2"
    assert [allowed_layouts(policy, TP2DP2, w) for w in (4, 1)] == [[TP2DP2], []]


def test_micro_batch_is_the_largest_divisor_not_above_it() -> None:
    assert [micro_for(n, 4) for n in (4, 6, 5, 2)] == [4, 3, 1, 2]


def test_no_layout_names_what_would_work() -> None:
    with pytest.raises(ConfigError) as e:
        replan(16, 3, 3, DP4, micro_batch=4)
    text = str(e.value)
    assert "for 3 ranks divides train.global_batch 16" in text
    assert "would work: 1 ranks (dp1), 2 ranks (dp2), 4 ranks (dp4)" in text


def test_min_without_an_allowed_layout_is_refused_before_the_start() -> None:
    check_elastic(12, 3, DP4, 3, ())
    with pytest.raises(ConfigError, match=r"min_ranks: no allowed layout \(tp2xdp2, dp2\) for 3"):
        check_elastic(12, 3, TP2DP2, 6, ("tp2xdp2", "dp2"))
