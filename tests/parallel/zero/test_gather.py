"""Stage 3's per-unit gather/free state machine and its coordinator (no process group).

On one process the shard group has one rank: the all-gather is a counted copy that
completes at once, so the life-cycle can be driven and observed without workers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait import init_mesh
from plait.parallel.zero import ZeroDataParallel
from plait.parallel.zero.flat import FlatUnit, plan_units
from plait.parallel.zero.gather import GatherState, UnitGather


def _unit() -> tuple[FlatUnit, nn.Linear]:
    """One unit of a Linear(3, 2) with its full (padded,) values and its one shard."""
    lin = nn.Linear(3, 2)
    u = FlatUnit(0, plan_units(nn.Sequential(lin), None)[0], 1, 0)
    u.full = u.flatten()  # (8,)
    u.shard = u.full.clone()  # (8,) one shard: the whole unit
    return u, lin


def test_free_start_finish_round_trip() -> None:
    u, lin = _unit()
    weight = lin.weight.detach().clone()
    g, group = UnitGather(u), init_mesh().axis("dp")
    assert g.state is GatherState.GATHERED  # set-up: the full values are in place
    g.free()
    assert g.state is GatherState.FREE
    assert lin.weight.numel() == 0 and u.full.untyped_storage().nbytes() == 0
    out = g.start(group, torch.device("cpu"))
    assert g.state is GatherState.GATHERING and out.shape == (u.padded,)
    g.finish()
    assert g.state is GatherState.GATHERED and g.out is None
    assert torch.equal(lin.weight, weight)  # a view into the refilled flat buffer
    assert lin.weight.data_ptr() == u.full.data_ptr()


def test_a_gather_in_flight_can_be_freed() -> None:
    u, lin = _unit()
    g, group = UnitGather(u), init_mesh().axis("dp")
    g.free()
    g.start(group, torch.device("cpu"))
    g.free()  # waits for the gather and drops its output
    assert g.state is GatherState.FREE and g.out is None and lin.weight.numel() == 0


def test_illegal_transitions_raise_naming_the_unit() -> None:
    u, _ = _unit()
    g, group = UnitGather(u), init_mesh().axis("dp")
    with pytest.raises(RuntimeError, match=r"unit '0'.*cannot go from gathered to gathering"):
        g.start(group, torch.device("cpu"))  # already gathered
    g.free()
    with pytest.raises(RuntimeError, match="cannot go from free to free"):
        g.free()


# ----------------------------------------------------------------------------- gatherer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_stage3_gathers_each_unit_for_forward_and_backward_and_frees_it() -> None:
    model = _model()
    zdp = ZeroDataParallel(model, init_mesh(), 3, wrap=[nn.Linear], record_events=True)
    gatherer = zdp.gatherer
    assert gatherer is not None
    assert all(g.state is GatherState.FREE for g in gatherer.gathers)
    assert all(p.numel() == 0 for p in model.parameters())
    zdp(torch.randn(5, 4)).sum().backward()
    assert [u.name for u in zdp.driver.order] == ["0", "2"]
    assert all(g.state is GatherState.FREE for g in gatherer.gathers)
    assert zdp.gathered_bytes == 0 and zdp.peak_gathered_bytes > 0
    assert all(p.numel() == 0 for p in model.parameters())
    gathers = sorted(n for k, n in zdp.events if k == "gather")
    assert gathers == ["0", "0", "2", "2"]  # forward and backward


def test_gathered_holds_the_full_parameters_inside_the_block() -> None:
    model = _model()
    weight = model[2].weight.detach().clone()
    zdp = ZeroDataParallel(model, init_mesh(), 3, wrap=[nn.Linear])
    with zdp.gathered():
        assert torch.equal(model[2].weight, weight)
        assert zdp.peak_gathered_units == 2
    assert zdp.gathered_bytes == 0 and model[2].weight.numel() == 0


def test_no_gatherer_below_stage_3() -> None:
    zdp = ZeroDataParallel(_model(), init_mesh(), 2, wrap=[nn.Linear])
    assert zdp.gatherer is None and zdp.gathered_bytes == zdp.peak_gathered_bytes == 0
