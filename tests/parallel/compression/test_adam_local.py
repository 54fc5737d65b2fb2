"""Adam's moments in front of top-k (:mod:`plait.parallel.compression.adam_local`): the
per-rank step direction equals torch's Adam, the dp2 reduction equals a one-process
reference of the same recursion, and the trainer pairs it with plain SGD.

Tolerances: float64 throughout; directions and reductions to 1e-12.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from plait import init_mesh
from plait.config import Config, ModelConfig
from plait.model import Transformer
from plait.optim import Optimizer
from plait.parallel.compression import LocalAdam, TopKCompressor, adam_in_front
from plait.parallel.compression.topk import topk_count
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext, WorkerPool
from plait.train.start import make_optimizer
from tests.parallel.compression.adam_reference import local_adam_updates
from tests.parallel.compression.test_topk_dgc import MATRICES, NUMEL, SHAPES, _grad

M = "tests.parallel.compression.test_adam_local"


def test_direction_equals_torch_adam() -> None:
    """u_t is what torch's Adam (lr 1, no decay) subtracts from a parameter at step t."""
    p = torch.zeros(NUMEL, dtype=torch.float64, requires_grad=True)
    adam = torch.optim.Adam([p], lr=1.0, betas=(0.9, 0.95), eps=1e-8)
    local = LocalAdam(0.9, 0.95, 1e-8)
    for step in range(5):
        g = _grad(0, step)
        before = p.detach().clone()
        p.grad = g.clone()
        adam.step()
        u = local.update(0, g, step + 1)
        torch.testing.assert_close(before - p.detach(), u, rtol=1e-12, atol=1e-12)


def _reference(grads: list[torch.Tensor], rho: float, n: int) -> list[torch.Tensor]:
    """One rank, written out: Adam's moments of its own gradient, u / n error-fed, the
    top-k entries of each matrix (vectors whole) sent."""
    e = torch.zeros(NUMEL, dtype=torch.float64)
    out = []
    for u in local_adam_updates(grads, n):
        acc = e + u
        mask = torch.zeros(NUMEL, dtype=torch.bool)
        mask[240:250] = True  # the vectors go whole
        mask[370:] = True
        for off, size in MATRICES:
            mask[acc[off : off + size].abs().topk(topk_count(size, rho)).indices + off] = True
        out.append(torch.where(mask, acc, torch.zeros_like(acc)))
        e = torch.where(mask, torch.zeros_like(acc), acc)
    return out


def _body(ctx: WorkerContext, steps: int) -> list[torch.Tensor]:
    group = ctx.mesh(dp=ctx.world_size).axis("dp")
    c = TopKCompressor(0.1, adam=LocalAdam(0.9, 0.95, 1e-8))
    out = []
    for step in range(steps):
        flat = _grad(group.index, step) / group.size  # pre-divided, as buckets are
        c.reduce(0, flat, SHAPES, group)()
        c.end_step()
        out.append(flat)
    return out


def test_adam_before_topk_matches_the_reference_at_dp2(
    pools: Callable[[int], WorkerPool],
) -> None:
    steps = 6
    results = pools(2).run(f"{M}:_body", steps)
    refs = [_reference([_grad(r, s) for s in range(steps)], 0.1, 2) for r in (0, 1)]
    for step in range(steps):
        want = refs[0][step] + refs[1][step]  # rank order, as the compressor adds
        for r in results:
            torch.testing.assert_close(r[step], want, rtol=1e-12, atol=1e-12)


def test_state_round_trip_and_plain_steps_send_everything() -> None:
    group = init_mesh().axis("dp")
    a = TopKCompressor(0.1, start=2, adam=LocalAdam(0.9, 0.95))
    assert a.active and a.ratio_at(0) == 1.0 and a.ratio_at(2) == 0.1
    a.reduce(3, _grad(0, 0), SHAPES, group)()
    a.end_step()
    b = TopKCompressor(0.1, start=2, adam=LocalAdam(0.9, 0.95))
    b.load_state_dict({k: v.clone() for k, v in a.state_dict().items()})
    assert b.adam is not None and b.adam.exp_avg.keys() == {3}
    x, y = _grad(0, 1), _grad(0, 1)
    a.reduce(3, x, SHAPES, group)()
    b.reduce(3, y, SHAPES, group)()
    assert torch.equal(x, y)
    with pytest.raises(ValueError, match="not both"):
        TopKCompressor(0.1, momentum=0.9, adam=LocalAdam())
    assert "Adam moments before top-k" in a.describe()


def test_trainer_pairs_it_with_sgd_and_adamw_is_refused() -> None:
    cfg = Config()
    cfg.model = ModelConfig(dim=32, n_layers=1, n_heads=4, max_seq_len=16)
    cfg.parallel.compression = "topk"
    mesh = init_mesh()
    pm = parallelize(Transformer(cfg.model, seed=0), mesh, cfg)
    assert adam_in_front(pm)
    assert isinstance(pm.compressor, TopKCompressor) and pm.compressor.clip == 1.0
    opt = make_optimizer(pm, cfg)
    assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0.0
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    with pytest.raises(ValueError, match="compression_adam"):
        Optimizer(pm, torch.optim.AdamW(pm.parameters()))
    cfg.parallel.compression_adam = "after"
    after = parallelize(Transformer(cfg.model, seed=0), mesh, cfg)
    assert not adam_in_front(after)
    assert type(make_optimizer(after, cfg)) is torch.optim.AdamW


def test_residual_follows_the_learning_rate() -> None:
    """With a changing learning rate lr_t, lr_t times what is sent equals the written-out
    recursion in parameter units (acc = e + lr_t * u, the top-k of acc sent), so a
    direction held back while the rate decays still arrives in full; and the rate is
    part of the state."""
    group = init_mesh().axis("dp")
    c = TopKCompressor(0.1, adam=LocalAdam(0.9, 0.95, 1e-8))
    rates = [1e-3, 2e-3, 3e-3, 2e-3, 1e-3, 5e-4]
    m = torch.zeros(NUMEL, dtype=torch.float64)
    v = torch.zeros(NUMEL, dtype=torch.float64)
    e = torch.zeros(NUMEL, dtype=torch.float64)
    for t, lr in enumerate(rates, start=1):
        g = _grad(0, t)
        m = 0.9 * m + 0.1 * g
        v = 0.95 * v + 0.05 * g * g
        acc = e + lr * (m / (1 - 0.9**t)) / ((v / (1 - 0.95**t)).sqrt() + 1e-8)
        mask = torch.zeros(NUMEL, dtype=torch.bool)
        mask[240:250] = True
        mask[370:] = True
        for off, size in MATRICES:
            mask[acc[off : off + size].abs().topk(topk_count(size, 0.1)).indices + off] = True
        want = torch.where(mask, acc, torch.zeros_like(acc))
        e = torch.where(mask, torch.zeros_like(acc), acc)
        c.set_lr(lr)
        flat = g.clone()
        c.reduce(0, flat, SHAPES, group)()
        c.end_step()
        torch.testing.assert_close(lr * flat, want, rtol=1e-12, atol=1e-15)
    state = c.state_dict()
    assert float(state["lr"]) == rates[-1]
    d = TopKCompressor(0.1, adam=LocalAdam(0.9, 0.95, 1e-8))
    d.load_state_dict(state)
    assert d.lr == rates[-1]
