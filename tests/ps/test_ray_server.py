"""The parameter server on Ray actors: the semantics and records of the gloo version.

- sync equals data parallelism (plait DataParallel on 2 gloo ranks, the same global
  batches, AdamW, float64; rtol 1e-9 / atol 1e-10 on the weights after 5 steps), with
  one server; every version of the weights was ``ray.put`` exactly once;
- bounded staleness s = 1 with a deterministically slow worker (extra matrix products,
  nobody sleeps): no applied gradient is older than s, every worker does exactly its
  steps, and each version was put once.

The session's Ray instance (``ray_instance`` in tests/conftest.py) runs the actors.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from plait.ps.core import PSConfig
from plait.testing import WorkerPool
from tests.ps.test_server import STEPS, _adamw, _dp_reference, _loss, _model, _weights

pytest.importorskip("ray")


def _worker_loss(slow_worker: int, workers: int) -> Callable[[nn.Module, int, int], torch.Tensor]:
    heavy = torch.ones(96, 96)

    def loss_fn(model: nn.Module, worker: int, step: int) -> torch.Tensor:
        if worker == slow_worker:  # deterministic extra compute
            for _ in range(300):
                heavy.mul_(0.5).add_(torch.mm(heavy, heavy).mul_(1e-4))
        return _loss(model, worker, workers, step)

    return loss_fn


@pytest.mark.slow
def test_sync_equals_data_parallel_and_puts_once_per_version(
    ray_instance: Path, pools: Callable[[int], WorkerPool]
) -> None:
    from plait.ps.ray_server import train_parameter_server_ray

    model = _model()
    cfg = PSConfig(servers=1, mode="sync", steps=STEPS)
    run = train_parameter_server_ray(model, _model, _worker_loss(-1, 2), _adamw, cfg, workers=2)
    for got, want in zip(_weights(model), _dp_reference(pools), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    (sv,) = run.servers
    assert sv.steps == STEPS and len(sv.records) == STEPS * 2
    assert {a.staleness for a in sv.records} == {0}
    assert run.puts == [{v: 1 for v in range(STEPS + 1)}]  # versions 0..5, one put each
    assert [w.steps for w in run.workers] == [STEPS, STEPS]
    # in each step but the last (whose reply, 'stop', goes out at once) the first of the
    # two pushes waited for the other, as in the gloo version
    assert sum(sv.blocked) == STEPS - 1


@pytest.mark.slow
def test_bounded_staleness_never_exceeds_s(ray_instance: Path) -> None:
    from plait.ps.ray_server import train_parameter_server_ray

    steps, s = 6, 1
    cfg = PSConfig(servers=2, mode="bounded", staleness=s, steps=steps)
    run = train_parameter_server_ray(_model(), _model, _worker_loss(1, 2), _adamw, cfg, workers=2)
    for sv in run.servers:
        assert sv.steps == steps and len(sv.records) == steps * 2
        assert max(a.staleness for a in sv.records) <= s
        assert sv.max_staleness() <= s
    assert [w.steps for w in run.workers] == [steps, steps]
    assert run.puts == [{v: 1 for v in range(steps + 1)}] * 2
