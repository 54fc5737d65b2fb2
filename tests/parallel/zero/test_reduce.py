"""The per-unit gradient-reduction state machine and its coordinator (no process group).

On one process every group has one rank: the collectives are counted no-ops that
complete at once, so the life-cycle can be driven and observed without workers. Stage 2's
gradient buffers kept across steps are checked on 2 gloo ranks (the reduce-scatter inputs
of every step are the same storage).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from plait import comm, init_mesh
from plait.comm import AxisGroup
from plait.errors import ConfigError, UnusedParametersError
from plait.parallel.zero import ZeroDataParallel
from plait.parallel.zero.flat import FlatUnit, plan_units
from plait.parallel.zero.reducer import GradientReducer
from plait.parallel.zero.unit_reduction import ReduceState, UnitReduction
from plait.testing import WorkerContext, WorkerPool

M = "tests.parallel.zero.test_reduce"


def _unit() -> FlatUnit:
    """One unit of a Linear(3, 2): weight (2, 3) and bias (2,), 8 elements, one shard."""
    spec = plan_units(nn.Sequential(nn.Linear(3, 2)), None)[0]
    return FlatUnit(0, spec, 1, 0)


def _group() -> AxisGroup:
    return init_mesh().axis("dp")  # one rank, no process group


def test_collecting_until_every_parameter_has_its_gradient() -> None:
    r = UnitReduction(_unit())
    assert r.state is ReduceState.IDLE and not r.complete
    assert r.mark_ready(0) is True  # the unit's first gradient
    assert r.state is ReduceState.COLLECTING and not r.complete
    assert r.mark_ready(1) is False
    assert r.complete


@pytest.mark.parametrize("keep", [True, False])
def test_the_whole_life_cycle(keep: bool) -> None:
    """IDLE -> COLLECTING -> SCATTERING -> REPLICATING -> REDUCED (stages 0/1, ``keep``)
    or back to IDLE (stages 2/3, the caller adds the shard into its gradient shard)."""
    r, g = UnitReduction(_unit()), _group()
    r.mark_ready(0)
    r.mark_ready(1)
    buffer = torch.arange(8.0)  # (padded,)
    r.launch(buffer, g)
    assert r.state is ReduceState.SCATTERING and r.in_flight
    r.finish_scatter(g)
    assert r.state is ReduceState.REPLICATING and r.in_flight
    out = r.finish(keep=keep)
    assert torch.equal(out, buffer)  # the average over one rank
    assert not r.ready and not r.in_flight
    if keep:
        assert r.state is ReduceState.REDUCED and r.shard is out
        r.reset()
    assert r.state is ReduceState.IDLE and r.shard is None


def test_next_backward_may_start_from_a_kept_shard() -> None:
    r, g = UnitReduction(_unit()), _group()
    r.launch(torch.ones(8), g)  # from IDLE: no gradient arrived (find_unused_parameters)
    r.finish_scatter(g)
    r.finish(keep=True)
    assert r.mark_ready(1) is True and r.state is ReduceState.COLLECTING


def test_illegal_transitions_raise_naming_the_unit() -> None:
    r, g = UnitReduction(_unit()), _group()
    with pytest.raises(RuntimeError, match=r"unit '0'.*cannot go from idle to replicating"):
        r._go(ReduceState.REPLICATING)
    r.launch(torch.ones(8), g)
    with pytest.raises(RuntimeError, match="reset while a reduction is in flight"):
        r.reset()
    with pytest.raises(RuntimeError, match="cannot go from scattering to collecting"):
        r.mark_ready(0)  # a gradient after the unit was launched
    with pytest.raises(RuntimeError, match="cannot go from scattering to scattering"):
        r.launch(torch.ones(8), g)  # launched twice
    r.finish_scatter(g)
    with pytest.raises(RuntimeError, match="cannot go from replicating to collecting"):
        r.mark_ready(0)


# ----------------------------------------------------------------------------- reducer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _units_wrap() -> list[type[nn.Module]]:
    return [nn.Linear]  # one unit per Linear: two units


@pytest.mark.parametrize("stage", [2, 3])
def test_stages_2_3_reduce_every_backward_and_return_to_idle(stage: int) -> None:
    zdp = ZeroDataParallel(_model(), init_mesh(), stage, wrap=_units_wrap(), record_events=True)
    zdp(torch.randn(5, 4)).sum().backward()
    states = [r.state for r in zdp.reducer.units]
    assert states == [ReduceState.IDLE] * 2
    assert zdp.grad_buffer_bytes == 0 < zdp.peak_grad_buffer_bytes
    ev = [e for e in zdp.events if e[0] in ("backward", "grad", "reduce", "synced")]
    assert ev[0] == ("backward", "") and ev[-1] == ("synced", "")
    # the last layer's gradients come first: it is reduced before the first has any
    assert ev.index(("reduce", "2")) < ev.index(("grad", "0"))
    assert all(g.abs().sum() > 0 for g in (zdp.reduced_grad(u) for u in zdp.units))


def test_stage_1_keeps_the_reduced_shard_until_zero_grad() -> None:
    zdp = ZeroDataParallel(_model(), init_mesh(), 1, wrap=_units_wrap())
    x = torch.randn(5, 4)
    with zdp.no_sync():  # accumulates locally: nothing to reduce
        zdp(x).sum().backward()
    assert [r.state for r in zdp.reducer.units] == [ReduceState.IDLE] * 2
    zdp(x).sum().backward()
    assert [r.state for r in zdp.reducer.units] == [ReduceState.REDUCED] * 2
    grads = [zdp.reduced_grad(u).clone() for u in zdp.units]
    zdp.zero_grad()
    assert [r.state for r in zdp.reducer.units] == [ReduceState.IDLE] * 2
    for u, g in zip(zdp.units, grads, strict=True):
        assert g.abs().sum() > 0 and not zdp.reduced_grad(u).any()


def test_a_parameter_without_gradient_is_refused_and_the_units_reset() -> None:
    model = _model()
    zdp = ZeroDataParallel(model, init_mesh(), 2, wrap=_units_wrap())
    first = model[0]
    with pytest.raises(UnusedParametersError, match=r"no gradient.*find_unused_parameters"):
        first(torch.randn(5, 4)).sum().backward()  # the last Linear gets no gradient
    assert [r.state for r in zdp.reducer.units] == [ReduceState.IDLE] * 2
    assert zdp.grad_buffer_bytes == 0 and not zdp.reducer.in_backward


# ----------------------------------------------------------------------------- other drivers


def _hooks(model: nn.Module) -> dict[str, int]:
    """The autograd driver's kinds of hook on ``model``, counted."""
    mods = list(model.modules())
    return {
        "grad": sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()),
        "pre": sum(len(m._forward_pre_hooks) for m in mods),
        "post": sum(len(m._forward_hooks) for m in mods),
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_the_driver_is_chosen_once_and_the_schedule_gets_no_hook(stage: int) -> None:
    """Built for the schedule, the wrapper never builds the autograd driver: no hook on a
    parameter or module (built for autograd, the same model has them)."""
    hooked = _model()
    ZeroDataParallel(hooked, init_mesh(), stage, wrap=_units_wrap())
    assert _hooks(hooked)["grad"] == 4  # one per parameter
    assert (_hooks(hooked)["pre"] > 0) == (stage == 3)
    model = _model()
    zdp = ZeroDataParallel(model, init_mesh(), stage, wrap=_units_wrap(), driver="schedule")
    assert zdp.driver is None and zdp.driven_by == "schedule"
    assert _hooks(model) == {"grad": 0, "pre": 0, "post": 0}
    assert zdp.drive.units is zdp.units and zdp.drive.gatherer is zdp.gatherer
    assert zdp.reducer.on_launch is None  # the autograd driver's free-on-launch


@pytest.mark.parametrize("stage", [0, 1])
def test_the_schedule_drives_only_stages_2_and_3(stage: int) -> None:
    with pytest.raises(ConfigError, match="schedule drives ZeRO stages 2 and 3"):
        ZeroDataParallel(_model(), init_mesh(), stage, driver="schedule")


def test_an_external_driver_reduces_accumulated_gradients_through_the_reducer() -> None:
    """The pipeline's entry (``reduce`` on ``.grad`` accumulated over two backwards, a unit
    reduced twice before ``finish``): built for the schedule, autograd reduces nothing;
    each reduction's shard is added into ``grad_shard`` and the units end IDLE."""
    model = _model()
    zdp = ZeroDataParallel(
        model, init_mesh(), 2, wrap=_units_wrap(), record_events=True, driver="schedule"
    )
    assert zdp.driver is None and zdp.drive.reducer is zdp.reducer
    x = torch.randn(5, 4)
    zdp(x).sum().backward()
    zdp(x).sum().backward()  # accumulates in .grad: no hook reduces it
    assert not zdp.events and zdp.reducer.on_launch is None
    want = {u.index: torch.cat([p.grad.flatten() for p in u.params]) for u in zdp.units}
    last = zdp.units[1]
    zdp.reducer.reduce(last)
    last.params[0].grad = torch.ones_like(last.params[0])  # a second round of one unit
    last.params[1].grad = torch.ones_like(last.params[1])
    zdp.reducer.reduce(last)
    zdp.reducer.reduce(zdp.units[0])
    assert all(p.grad is None for p in model.parameters())
    zdp.reducer.finish()
    assert [r.state for r in zdp.reducer.units] == [ReduceState.IDLE] * 2
    assert zdp.grad_buffer_bytes == 0 < zdp.peak_grad_buffer_bytes
    torch.testing.assert_close(zdp.reduced_grad(zdp.units[0])[: zdp.units[0].numel], want[0])
    got = zdp.reduced_grad(last)[: last.numel]
    torch.testing.assert_close(got, want[1] + 1)
    assert [k for k, _ in zdp.events].count("reduce") == 3


def test_an_external_driver_is_refused_parameters_without_gradient() -> None:
    model = _model()
    zdp = ZeroDataParallel(model, init_mesh(), 3, wrap=_units_wrap(), driver="schedule")
    with zdp.gathered():
        model[0](torch.randn(5, 4)).sum().backward()  # the last Linear gets no gradient
    zdp.reducer.reduce(zdp.units[0])
    with pytest.raises(UnusedParametersError, match="find_unused_parameters") as e:
        zdp.reducer.reduce(zdp.units[1])
    assert e.value.names == ["2.weight", "2.bias"]
    assert [r.state for r in zdp.reducer.units] == [ReduceState.IDLE] * 2
    assert zdp.grad_buffer_bytes == 0


# ----------------------------------------------------------------------------- kept buffers


def _body_kept(ctx: WorkerContext, bucket_mb: float | None) -> dict[str, Any]:
    """Three ZeRO-2 steps; the data pointers of every reduce-scatter input per step."""
    from plait.config import ModelConfig
    from plait.model import Transformer, lm_loss
    from plait.optim import Optimizer

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, max_seq_len=8)
    model = Transformer(cfg, seed=0)
    zdp = ZeroDataParallel(model, ctx.mesh(dp=ctx.world_size), 2, bucket_mb=bucket_mb)
    opt = Optimizer(zdp, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(ctx.rank))
    inputs: list[int] = []
    real = comm.reduce_scatter

    def spy(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        inputs.append(t.data_ptr())
        return real(t, *args, **kwargs)

    steps, rings = [], []
    comm.reduce_scatter = spy  # type: ignore[assignment]  (the reducer calls comm.reduce_scatter)
    try:
        for _ in range(3):
            inputs.clear()
            opt.zero_grad()
            lm_loss(zdp(x), x).backward()
            opt.step()
            steps.append(list(inputs))
            rings.append(zdp.reducer.ring.data_ptrs)  # type: ignore[union-attr]
    finally:
        comm.reduce_scatter = real  # type: ignore[assignment]
    red = zdp.reducer
    return {
        "steps": steps,
        "rings": rings,
        "kept": red.kept_grad_buffer_bytes,
        "buckets": [b.numel * 4 for b in red.buckets],
        "in_use": red.grad_buffer_bytes,
        "peak": red.peak_grad_buffer_bytes,
    }


@pytest.mark.parametrize("bucket_mb", [None, 0.02, 1.0])
def test_stage_2_reuses_its_gradient_buffers_across_steps(
    pools: Callable[[int], WorkerPool], bucket_mb: float | None
) -> None:
    """Every reduce-scatter input of steps 2 and 3 is a buffer of step 1 (data pointers)
    and none is allocated after step 1. The ring keeps K = MAX_REDUCES_IN_FLIGHT + 1
    buffers of the largest bucket (one bucket per unit, or buckets of 0.02 MiB: less than
    the model's gradients) or each bucket's own when that is less (one 1 MiB bucket)."""
    slots = GradientReducer.MAX_REDUCES_IN_FLIGHT + 1
    for r in pools(2).run(f"{M}:_body_kept", bucket_mb):
        first, sizes = set(r["steps"][0]), r["buckets"]
        assert len(r["steps"][0]) == len(sizes) and (len(sizes) > slots) == (bucket_mb != 1.0)
        assert r["rings"][0] == r["rings"][1] == r["rings"][2]  # nothing allocated since
        assert first <= set(r["rings"][0])
        for later in r["steps"][1:]:
            assert set(later) <= first and len(later) == len(sizes)
        assert r["kept"] == min(slots * max(sizes), sum(sizes))
        if bucket_mb != 1.0:  # K buffers of the largest bucket: less than the gradients
            assert len(r["rings"][0]) == slots and r["kept"] < sum(sizes)
        assert r["in_use"] == 0 < r["peak"] <= r["kept"]
