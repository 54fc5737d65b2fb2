"""The per-unit gradient-reduction state machine (no process group needed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.parallel.zero.flat import FlatUnit, plan_units
from plait.parallel.zero.reduce import ReduceState, UnitReduction


def _unit() -> FlatUnit:
    spec = plan_units(nn.Sequential(nn.Linear(3, 2)), None)[0]
    return FlatUnit(0, spec, 1, 0)


def test_collecting_until_every_parameter_has_its_gradient() -> None:
    r = UnitReduction(_unit())
    assert r.state is ReduceState.IDLE and not r.complete
    assert r.mark_ready(0) is True  # the unit's first gradient
    assert r.state is ReduceState.COLLECTING and not r.complete
    assert r.mark_ready(1) is False
    assert r.complete


def test_illegal_transitions_raise_naming_the_unit() -> None:
    r = UnitReduction(_unit())
    with pytest.raises(RuntimeError, match="cannot go from idle to replicating"):
        r._go(ReduceState.REPLICATING)
    r.state = ReduceState.SCATTERING
    with pytest.raises(RuntimeError, match="reset while a reduction is in flight"):
        r.reset()
    with pytest.raises(RuntimeError, match="cannot go from scattering to collecting"):
        r.mark_ready(0)


def test_a_kept_shard_is_dropped_by_reset() -> None:
    r = UnitReduction(_unit())
    r.mark_ready(0)
    r.state, r.shard = ReduceState.REPLICATING, torch.ones(4)
    out = r.finish(keep=True)
    assert r.state is ReduceState.REDUCED and torch.equal(out, torch.ones(4)) and not r.ready
    r.reset()
    assert r.state is ReduceState.IDLE and r.shard is None
