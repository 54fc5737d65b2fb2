"""Parameter-server training: the three consistency models on real gloo ranks.

- sync equals data parallelism (plait DataParallel on 2 ranks, same global batches,
  AdamW, float64; rtol 1e-9 / atol 1e-10 on the weights after 5 steps), with 1 server
  and with 2 servers (sharded parameters);
- bounded staleness with s = 0 is sync, bit for bit;
- async with one deterministically slow worker (it runs extra matrix products before
  each step; nobody sleeps): fast workers do more steps, staleness > 0 is recorded;
- bounded staleness s = 2 with the same slow worker: no recorded gradient is older
  than s, every worker does exactly its steps, and the fast workers were held back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from plait.errors import ConfigError
from plait.parallel.data_parallel import DataParallel
from plait.ps.core import PSConfig
from plait.ps.server import train_parameter_server
from plait.testing import WorkerContext, WorkerPool

M = "tests.ps.test_server"
Pools = Callable[[int], WorkerPool]
GLOBAL_BATCH = 12
STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=torch.float64)  # (B, 6)
    y = torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)  # (B,)
    return x, y


def _loss(model: nn.Module, part: int, parts: int, step: int) -> torch.Tensor:
    x, y = _batch(step)
    n = GLOBAL_BATCH // parts
    return nn.functional.cross_entropy(
        model(x[part * n : (part + 1) * n]), y[part * n : (part + 1) * n]
    )


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _body_dp(ctx: WorkerContext) -> list[torch.Tensor]:
    mesh = ctx.mesh(dp=ctx.world_size)
    model = _model()
    dp = DataParallel(model, mesh)
    opt = _adamw(list(model.parameters()))
    for step in range(STEPS):
        opt.zero_grad()
        _loss(dp, mesh.index("dp"), ctx.world_size, step).backward()
        opt.step()
    return _weights(model)


def _body_ps(
    ctx: WorkerContext, servers: int, mode: str, staleness: int, steps: int, slow_work: int
) -> dict[str, Any]:
    g = ctx.mesh(dp=ctx.world_size).axis("dp")
    workers = ctx.world_size - servers
    heavy = torch.ones(96, 96)

    def loss_fn(model: nn.Module, worker: int, step: int) -> torch.Tensor:
        if worker == workers - 1:  # the slow worker: deterministic extra compute
            for _ in range(slow_work):
                heavy.mul_(0.5).add_(torch.mm(heavy, heavy).mul_(1e-4))
        return _loss(model, worker, workers, step)

    model = _model()
    cfg = PSConfig(servers=servers, mode=mode, staleness=staleness, steps=steps)  # type: ignore[arg-type]
    res = train_parameter_server(model, g, loss_fn, _adamw, cfg)
    out = dataclasses.asdict(res)
    out["staleness"] = [a.staleness for a in res.records]
    out["weights"] = _weights(model)
    out["sent"] = dataclasses.asdict(g.stats.get(g.name, "send"))
    return out


def _dp_reference(pools: Pools) -> list[torch.Tensor]:
    ref = pools(2).run(f"{M}:_body_dp")
    for r in ref[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r, ref[0], strict=True))
    return ref[0]


@pytest.mark.parametrize(("world", "servers"), [(3, 1), (4, 2)])
def test_sync_equals_data_parallel(pools: Pools, world: int, servers: int) -> None:
    ref = _dp_reference(pools)
    results = pools(world).run(f"{M}:_body_ps", servers, "sync", 0, STEPS, 0)
    for r in results:  # every rank ends with the final weights
        for got, want in zip(r["weights"], ref, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    for sv in results[:servers]:
        assert sv["role"] == "server" and sv["steps"] == STEPS
        assert len(sv["records"]) == STEPS * (world - servers)
        assert set(sv["staleness"]) == {0}
    for wk in results[servers:]:
        assert wk["role"] == "worker" and wk["steps"] == STEPS and len(wk["losses"]) == STEPS
    # traffic from the comm counters: every message is a 32-byte header + one fp64 shard;
    # a worker pushes one per server and step, a server sends the initial weights and
    # one reply per worker and step (the final broadcast is not a send)
    workers, numel = world - servers, sum(p.numel() for p in _model().parameters())
    per_round = servers * 32 + numel * 8  # one message to (or from) every server
    for wk in results[servers:]:
        assert wk["sent"]["calls"] == STEPS * servers
        assert wk["sent"]["bytes"] == STEPS * per_round
    assert sum(sv["sent"]["calls"] for sv in results[:servers]) == (STEPS + 1) * workers * servers
    assert sum(sv["sent"]["bytes"] for sv in results[:servers]) == (STEPS + 1) * workers * per_round


def test_bounded_zero_is_sync(pools: Pools) -> None:
    sync = pools(3).run(f"{M}:_body_ps", 1, "sync", 0, 3, 0)
    bounded = pools(3).run(f"{M}:_body_ps", 1, "bounded", 0, 3, 0)
    for a, b in zip(sync, bounded, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
        assert a["records"] == b["records"]


SLOW = 400  # extra 96x96 matrix products per step of the slow worker (~50x a fast step)


def test_async_fast_workers_do_more_steps(pools: Pools) -> None:
    res = pools(4).run(f"{M}:_body_ps", 1, "async", 0, 6, SLOW)
    server, workers = res[0], res[1:]
    steps = [w["steps"] for w in workers]
    assert server["worker_steps"] == steps  # both sides count the same pushes
    assert sum(steps) == 6 * 3 == len(server["records"]) == server["steps"]
    assert min(steps[:2]) > steps[2], steps  # the slow worker is the last one
    assert max(server["staleness"]) > 0
    # each gradient is applied to the version after the previous one
    assert [r["version"] for r in server["records"]] == list(range(18))
    assert sum(server["blocked"]) == 0  # async never withholds a reply
    for r in res[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["weights"], res[0]["weights"], strict=True))


def test_async_with_two_servers(pools: Pools) -> None:
    res = pools(4).run(f"{M}:_body_ps", 2, "async", 0, 4, 0)
    for sv in res[:2]:
        assert sv["steps"] == 8 and sv["worker_steps"] == [w["steps"] for w in res[2:]]
    assert sum(w["steps"] for w in res[2:]) == 8


@pytest.mark.parametrize("s", [1, 2])
def test_bounded_staleness_bounds_and_blocks(pools: Pools, s: int) -> None:
    res = pools(4).run(f"{M}:_body_ps", 1, "bounded", s, 6, SLOW)
    server, workers = res[0], res[1:]
    assert [w["steps"] for w in workers] == [6, 6, 6]
    assert len(server["records"]) == 18
    assert max(server["staleness"]) <= s  # never older than s (from the record)
    for rec in server["records"]:
        assert rec["step"] - rec["read_version"] <= s  # at most s steps ahead
    assert max(server["staleness"]) >= 1  # the fast workers ran ahead of the slow one
    assert sum(server["blocked"][:2]) > 0  # ... and were held back at the bound


def test_bad_config() -> None:
    with pytest.raises(ConfigError, match="staleness must be >= 0"):
        PSConfig(mode="bounded", staleness=-1).validate(3)
    with pytest.raises(ConfigError, match="needs mode='bounded'"):
        PSConfig(mode="sync", staleness=2).validate(3)
    with pytest.raises(ConfigError, match="1 <= servers < world"):
        PSConfig(servers=3).validate(3)
    with pytest.raises(ConfigError, match="1 <= servers < world"):
        PSConfig(servers=0).validate(3)
    with pytest.raises(ConfigError, match="at least 2 ranks"):
        PSConfig().validate(1)
    with pytest.raises(ConfigError, match="mode 'gossip' unknown"):
        PSConfig(mode="gossip").validate(3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="steps must be >= 1"):
        PSConfig(steps=0).validate(3)


def _body_bad(ctx: WorkerContext) -> list[str]:
    g = ctx.mesh(dp=ctx.world_size).axis("dp")
    out = []
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    for model, cfg in [
        (_model(), PSConfig(mode="bounded", staleness=-1)),
        (mixed, PSConfig()),
    ]:
        try:
            train_parameter_server(model, g, lambda m, w, s: m(torch.ones(1)), _adamw, cfg)
            out.append("no error")
        except ConfigError as e:
            out.append(str(e))
    return out


def test_bad_input_refused_on_every_rank(pools: Pools) -> None:
    for msgs in pools(3).run(f"{M}:_body_bad"):
        assert "staleness must be >= 0" in msgs[0]
        assert "one floating dtype" in msgs[1]
