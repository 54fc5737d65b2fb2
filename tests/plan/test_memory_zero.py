"""ZeRO state bytes: the planner against the tensors the runtime allocates, per rank.

On 2 and 4 gloo ranks, plait's ZeroDataParallel (stages 1-3, full and hybrid sharding,
fp32 and bf16 with fp32 masters) wraps small models whose unit sizes do not divide the
shard count (so every unit is padded); after one optimizer step each rank reports its
exact bytes (:func:`plait.train.memory.memory_report`) and the planner must give the same
numbers for that rank: equality, no tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from plait.config import ModelConfig
from plait.plan.layout import PRECISIONS, RUNTIMES, Layout
from plait.plan.memory import memory_per_rank
from plait.plan.modelspec import ModelSpec
from plait.testing import WorkerPool
from tests.plan.queries import query

M = "tests.plan.test_memory_zero"

MODELS = {
    "gqa": ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16),
    "tied": ModelConfig(
        vocab_size=61, dim=24, n_layers=3, n_heads=2, ffn_dim=50, max_seq_len=16,
        tie_embeddings=True,
    ),
    "deep": ModelConfig(vocab_size=61, dim=24, n_layers=6, n_heads=2, max_seq_len=16),
}  # fmt: skip


def _body_state(ctx: Any, model: str, stage: int, shard: int | None, dtype: str) -> dict[str, int]:
    import torch

    from plait.model import Transformer, lm_loss
    from plait.optim import Optimizer
    from plait.parallel.zero import ZeroDataParallel
    from plait.train.memory import memory_report

    cfg = MODELS[model]
    mesh = ctx.mesh(dp=ctx.world_size)
    base = Transformer(cfg, seed=0)
    wrapped = ZeroDataParallel(base, mesh, stage, zero_shard_size=shard, param_dtype=dtype)
    opt = Optimizer(wrapped, torch.optim.AdamW(base.parameters(), lr=1e-3))
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    lm_loss(wrapped(x).float(), x).backward()
    opt.step()
    rep = memory_report(wrapped, opt, mesh.rank)
    b = rep.bytes
    return {
        "rank": mesh.index("dp"),
        "params": b["params"],
        "grads": b["grads"],
        "master": b["master"],
        "optimizer": b["optimizer"] + b["optimizer_scalars"],
    }


CASES = [
    (2, "gqa", 1, None, "fp32"),
    (2, "gqa", 2, None, "fp32"),
    (2, "tied", 3, None, "fp32"),
    (2, "tied", 2, None, "bf16"),
    (4, "gqa", 3, None, "fp32"),
    (4, "tied", 3, 2, "bf16"),
    (4, "gqa", 1, 2, "fp32"),
]


@pytest.mark.parametrize(("world", "model", "stage", "shard", "dtype"), CASES)
def test_zero_state_bytes_are_exact_on_every_rank(
    pools: Callable[[int], WorkerPool],
    world: int,
    model: str,
    stage: int,
    shard: int | None,
    dtype: str,
) -> None:
    results = pools(world).run(f"{M}:_body_state", model, stage, shard, dtype)
    spec = ModelSpec.from_config(MODELS[model])
    precision = PRECISIONS["fp32" if dtype == "fp32" else "bf16-mixed"]
    layout = Layout(dp=world, zero=stage, zero_shard_size=shard)
    f = layout.shard_factor
    for got in results:
        mem = memory_per_rank(
            query(spec, layout, precision, RUNTIMES["plait"], 8), layout, got["rank"] % f
        )
        want = {
            "params": mem.params,
            "grads": mem.grads,
            "master": mem.master,
            "optimizer": mem.optimizer,
        }
        assert {k: got[k] for k in want} == want, f"rank {got['rank']}"
    # the ranks differ (padding sits on the last rank of each unit): the model says so too
    if world == f:
        opt = {r["optimizer"] for r in results}
        assert len(opt) > 1


def _body_zero2_buffers(ctx: Any, model: str, bucket_mb: float) -> dict[str, int]:
    import torch

    from plait.model import Transformer, lm_loss
    from plait.optim import Optimizer
    from plait.parallel.zero import ZeroDataParallel

    cfg = MODELS[model]
    mesh = ctx.mesh(dp=ctx.world_size)
    base = Transformer(cfg, seed=0)
    wrapped = ZeroDataParallel(base, mesh, 2, bucket_mb=bucket_mb)
    opt = Optimizer(wrapped, torch.optim.AdamW(base.parameters(), lr=1e-3))
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    for _ in range(2):
        opt.zero_grad()
        lm_loss(wrapped(x), x).backward()
        opt.step()
    return {
        "rank": mesh.index("dp"),
        "kept": wrapped.reducer.kept_grad_buffer_bytes,
        "grads": sum(u.padded for u in wrapped.units) * 4,  # full padded fp32 gradients
        "units": len(wrapped.units),
    }


@pytest.mark.parametrize(("model", "bucket_mb"), [("gqa", 25.0), ("deep", 0.01)])
def test_zero2_kept_gradient_buffers_against_the_planner(
    pools: Callable[[int], WorkerPool], model: str, bucket_mb: float
) -> None:
    """ZeRO-2's reduce-scatter buffers kept across steps: the planner's
    ``min(K·(B + U·g), P·g)`` is the gradients (up to unit padding) when they fit in K
    buckets (25 MiB, 2 layers), and an upper bound below the gradients with small buckets
    (0.01 MiB, 6 layers: K buffers of the largest bucket)."""
    from dataclasses import replace

    from plait.parallel.zero.reducer import GradientReducer
    from plait.plan.memory import ZERO2_KEPT_BUCKETS

    assert ZERO2_KEPT_BUCKETS == GradientReducer.MAX_REDUCES_IN_FLIGHT + 1
    spec = ModelSpec.from_config(MODELS[model])
    runtime = replace(RUNTIMES["plait"], bucket_mb=bucket_mb)
    for got in pools(2).run(f"{M}:_body_zero2_buffers", model, bucket_mb):
        mem = memory_per_rank(
            query(spec, Layout(dp=2, zero=2), PRECISIONS["fp32"], runtime, 8),
            Layout(dp=2, zero=2),
            0,
        )
        if bucket_mb == 25.0:  # every bucket's own: the gradients, padded per unit
            assert got["kept"] == got["grads"]
            assert 0 <= got["kept"] - mem.buffers < got["units"] * 2 * 4
        else:
            assert got["kept"] < got["grads"] and got["kept"] <= mem.buffers < got["grads"]
