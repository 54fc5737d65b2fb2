"""Collective costs in the alpha-beta model and where groups sit on the cluster."""

from __future__ import annotations

import math

import pytest

from plait.plan.hardware import PRESETS, Link
from plait.plan.layout import Layout
from plait.plan.network import (
    all_gather_time,
    all_reduce_time,
    group,
    in_step_all_reduce_time,
    p2p_time,
    reduce_scatter_time,
)
from tests.plan.queries import query

LINK = Link(1e-5, 1e10)


def test_algorithms() -> None:
    s, n = 1e8, 8
    ring = all_reduce_time(s, n, LINK, "ring")
    tree = all_reduce_time(s, n, LINK, "tree")
    rd = all_reduce_time(s, n, LINK, "recursive_doubling")
    assert ring == pytest.approx(2 * 7 * 1e-5 + 2 * 7 / 8 * s / 1e10)
    assert tree == pytest.approx(2 * 3 * 1e-5 + 2 * s / 1e10)
    assert rd == pytest.approx(3 * (1e-5 + s / 1e10))
    assert all_reduce_time(s, n, LINK) == min(ring, tree)
    # small messages: latency-bound, the tree's log N steps win
    assert all_reduce_time(8, 64, LINK) == pytest.approx(2 * math.log2(64) * 1e-5 + 16 / 1e10)


def test_reduce_scatter_plus_all_gather_is_one_all_reduce() -> None:
    s, n = 3e7, 4
    both = reduce_scatter_time(s, n, LINK) + all_gather_time(s, n, LINK)
    assert both == pytest.approx(all_reduce_time(s, n, LINK, "ring"))


def test_degenerate_cases_cost_nothing() -> None:
    assert all_reduce_time(1e9, 1, LINK) == 0.0
    assert all_gather_time(0, 8, LINK) == 0.0
    assert p2p_time(0, LINK) == 0.0
    assert p2p_time(1e6, LINK) == pytest.approx(1e-5 + 1e-4)


def test_measured_fits_override_the_generic_link() -> None:
    link = Link(1e-5, 1e10, (("all_gather", 1e-3, 1e8),))
    assert all_gather_time(1e8, 2, link) == pytest.approx(1e-3 + 0.5)
    assert reduce_scatter_time(1e8, 2, link) == pytest.approx(1e-5 + 5e-3)


def test_in_step_all_reduce_uses_its_own_measurement_where_it_has_one() -> None:
    from plait.plan.hardware import Curve

    ar = Curve(((1e3, 1e-4), (1e6, 1e-3)))
    in_step = Curve(((1e3, 1e-3), (1e6, 2e-3)))
    link = Link(1e-5, 1e10, (), (("all_reduce", 2, ar), ("all_reduce_in_step", 2, in_step)))
    assert in_step_all_reduce_time(1e6, 2, link) == pytest.approx(2e-3)
    assert all_reduce_time(1e6, 2, link) == pytest.approx(1e-3)
    # outside its range or group size, and on profiles without it: the all-reduce
    assert in_step_all_reduce_time(1e7, 2, link) == all_reduce_time(1e7, 2, link)
    assert in_step_all_reduce_time(1e6, 4, link) == all_reduce_time(1e6, 4, link)
    assert in_step_all_reduce_time(1e6, 2, LINK) == all_reduce_time(1e6, 2, LINK)
    assert in_step_all_reduce_time(1e6, 1, link) == 0.0


def test_groups_inside_a_node_use_the_fast_link() -> None:
    hw = PRESETS["h100-80gb"]  # 8 per node
    lay = Layout(dp=16, tp=8)  # 128 devices, 16 nodes
    tp, dp = group(lay, hw, "tp"), group(lay, hw, "dp")
    assert (tp.size, tp.crosses_nodes, tp.link) == (8, False, hw.intra)
    assert (dp.size, dp.crosses_nodes, dp.link) == (16, True, hw.inter)
    # a whole job inside one node never crosses
    small = Layout(dp=4, tp=2)
    assert not group(small, hw, "dp").crosses_nodes
    # ZeRO's hybrid shard groups of 4 consecutive dp ranks with tp=2 fit in a node
    hybrid = Layout(dp=16, tp=2, zero=3, zero_shard_size=4)
    assert not group(hybrid, hw, "dp", size=4).crosses_nodes
    assert group(hybrid, hw, "dp", size=4, step=4).crosses_nodes


def test_overlap_hides_data_parallel_traffic_only_where_the_device_can() -> None:
    import dataclasses

    from plait.plan.estimate import step_time
    from plait.plan.layout import PRECISIONS, RUNTIMES
    from plait.plan.modelspec import MODEL_SPECS

    gpu = PRESETS["a100-80gb"]
    cpu_like = dataclasses.replace(gpu, comm_overlap=0.0)
    spec, rt, pr = MODEL_SPECS["gpt2-355m"], RUNTIMES["plait"], PRECISIONS["bf16-mixed"]
    for lay in (Layout(dp=8, micro_batch=4), Layout(dp=8, zero=3, micro_batch=4)):
        hidden = step_time(query(spec, lay, pr, rt, 1024, gpu), lay)
        exposed = step_time(query(spec, lay, pr, rt, 1024, cpu_like), lay)
        assert hidden.dp_comm < exposed.dp_comm
        assert hidden.dp_comm_total == exposed.dp_comm_total
        if lay.zero == 0:  # nothing hidden: all of it on the step
            assert exposed.dp_comm == pytest.approx(exposed.dp_comm_total)


def test_a_measured_curve_replaces_the_line_inside_its_range_and_group_size() -> None:
    from plait.plan.hardware import Curve

    curve = Curve(((1e3, 1e-3), (1e6, 4e-3)))
    link = Link(1e-5, 1e10, (), (("all_reduce", 2, curve), ("p2p", 2, curve)))
    assert all_reduce_time(1e3, 2, link) == pytest.approx(1e-3)
    assert all_reduce_time(1e6, 2, link) == pytest.approx(4e-3)
    assert all_reduce_time(3e4, 2, link) == pytest.approx(curve.at(3e4))
    line = all_reduce_time(3e4, 2, Link(1e-5, 1e10))
    assert all_reduce_time(3e4, 4, link) != curve.at(3e4)  # another group size: the line
    assert all_reduce_time(1e8, 2, link) == pytest.approx(all_reduce_time(1e8, 2, Link(1e-5, 1e10)))
    assert all_reduce_time(3e4, 2, link, "ring") == pytest.approx(line)  # explicit algorithm
    assert p2p_time(1e3, link) == pytest.approx(1e-3)
    assert all_gather_time(1e3, 2, link) == pytest.approx(1e-5 + 0.5e3 / 1e10)
