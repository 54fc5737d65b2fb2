"""The parameter-server core without any transport: the step and the grant policy.

Pushes are fed to :class:`ServerCore` by hand, in a chosen order, so each decision of
each consistency mode is checked exactly: who is answered, who is held back (and
released when), what the weights become (SGD with lr 1: w - mean of the gradients).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.errors import ConfigError
from plait.ps.core import (
    Applied,
    PSConfig,
    ServerCore,
    flat_grad,
    flat_params,
    load_shard,
    shard_bounds,
)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


def _core(mode: str, workers: int, steps: int, staleness: int = 0) -> ServerCore:
    cfg = PSConfig(mode=mode, staleness=staleness, steps=steps)  # type: ignore[arg-type]
    return ServerCore(0, torch.zeros(3, dtype=torch.float64), _sgd, cfg, workers)


def _g(*v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float64)  # (3,)


def test_sync_answers_a_step_when_every_worker_pushed_it() -> None:
    core = _core("sync", workers=2, steps=2)
    assert core.push(1, 0, 0, _g(2, 4, 6)) is None  # first to arrive: held back
    assert core.version == 0 and core.res.blocked == [0, 1]
    assert core.release() == []  # nothing applied yet
    assert core.push(0, 0, 0, _g(0, 0, 2)) is True  # the last: step 0 applied, go on
    assert core.version == 1
    assert torch.equal(core.w.detach(), -_g(1, 2, 4))  # w - mean (SGD, lr 1)
    assert core.release() == [1] and core.withheld == []
    assert core.res.records == [Applied(0, 0, 0, 0), Applied(1, 0, 0, 0)]
    # the last step: applied, then both are told to stop (nobody is held back)
    assert core.push(0, 1, 1, _g(0, 0, 0)) is False
    assert core.push(1, 1, 1, _g(0, 0, 0)) is False
    assert core.version == 2 and core.release() == []
    res = core.finish()
    assert res.steps == 2 and res.worker_steps == [2, 2] and res.max_staleness() == 0


def test_bounded_holds_back_a_worker_at_the_staleness_bound() -> None:
    core = _core("bounded", workers=2, steps=4, staleness=1)
    # worker 0 is fast: with s = 1 it may compute step 1 before step 0 is applied ...
    assert core.push(0, 0, 0, _g(1, 1, 1)) is True
    # ... but not step 2: it is s steps ahead of worker 1, which has not pushed step 0
    assert core.push(0, 1, 0, _g(1, 1, 1)) is None
    assert core.withheld == [(0, 2)] and core.res.blocked == [1, 0]
    assert core.release() == []
    assert core.push(1, 0, 0, _g(3, 3, 3)) is True  # step 0 complete -> version 1
    assert core.version == 1
    assert core.release() == [0]  # now 1 >= 2 - s: worker 0 may compute step 2
    assert core.push(1, 1, 1, _g(1, 1, 1)) is True  # step 1: worker 0 read version 0
    assert core.version == 2
    assert [a.staleness for a in core.res.records] == [0, 0, 1, 0]
    assert core.res.max_staleness() == 1  # never more than s


def test_bounded_with_zero_staleness_is_sync() -> None:
    sync, bounded = _core("sync", 2, 3), _core("bounded", 2, 3, staleness=0)
    pushes = [(1, 0, 0, _g(1, 2, 3)), (0, 0, 0, _g(3, 2, 1)), (0, 1, 1, _g(1, 0, 0))]
    for p in pushes:
        assert sync.push(*p) == bounded.push(*p)
        assert sync.release() == bounded.release()
    assert sync.res == bounded.res and torch.equal(sync.w, bounded.w)


def test_async_applies_each_gradient_and_grants_a_budget() -> None:
    core = _core("async", workers=2, steps=2)  # 4 gradients in the run
    assert core.push(0, 0, 0, _g(1, 0, 0)) is True  # one optimizer step, not a mean
    assert core.version == 1 and torch.equal(core.w.detach(), -_g(1, 0, 0))
    assert core.push(0, 1, 1, _g(0, 1, 0)) is True  # the 4th grant: the budget is used
    assert core.push(0, 2, 2, _g(0, 0, 1)) is False  # fast worker 0 did 3 steps
    assert core.push(1, 0, 0, _g(1, 1, 1)) is False  # slow worker 1: 1 step, read v0
    assert core.version == 4 and core.res.blocked == [0, 0] and core.release() == []
    assert [a.staleness for a in core.res.records] == [0, 0, 0, 3]
    assert torch.equal(core.w.detach(), -_g(2, 2, 2))
    assert core.finish().worker_steps == [3, 1]


def test_step_sums_in_the_given_order_and_reports_each_step() -> None:
    seen: list[int] = []
    cfg = PSConfig(mode="sync", steps=3)
    core = ServerCore(0, torch.ones(2), _sgd, cfg, 3, on_step=lambda: seen.append(0))
    core.apply([torch.tensor([1.0, 2.0]), torch.tensor([2.0, 4.0]), torch.tensor([3.0, 0.0])], [])
    assert torch.equal(core.w.detach(), torch.tensor([-1.0, -1.0])) and core.w.grad is None
    core.apply([torch.tensor([1.0, 1.0])], [])  # one gradient: not divided
    assert torch.equal(core.w.detach(), torch.tensor([-2.0, -2.0]))
    assert core.version == 2 and seen == [0, 0]


def test_finish_refuses_unanswered_pushes() -> None:
    core = _core("sync", workers=2, steps=2)
    core.push(0, 0, 0, _g(0, 0, 0))
    with pytest.raises(RuntimeError, match="withheld replies"):
        core.finish()


def test_flat_helpers_round_trip_and_refuse_mixed_dtypes() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    params = flat_params(model)
    numel = sum(p.numel() for p in params)
    assert numel == 11
    bounds = shard_bounds(numel, 3)
    assert bounds == [(0, 4), (4, 8), (8, 11)]
    new = torch.arange(numel, dtype=torch.float32)  # (numel,)
    for lo, hi in bounds:
        load_shard(params, new[lo:hi], lo, hi)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in params]), new)
    model[0].weight.grad = torch.ones(2, 3)
    assert torch.equal(flat_grad(params), torch.tensor([1.0] * 6 + [0.0] * 5))
    model[1].double()
    with pytest.raises(ConfigError, match="one floating dtype"):
        flat_params(model)
