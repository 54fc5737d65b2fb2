"""Saved activations under tensor (and sequence) parallelism: the planner against the
bytes autograd really saves on each of 2 gloo ranks (saved-tensor hooks, unique storages,
parameters and buffers excluded), for plait's Megatron-style layers in fp32. Equality."""

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

M = "tests.plan.test_activations_tp"
CFG = ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def _body_saved(ctx: Any, sp: bool, batch: int, seq: int) -> int:
    import torch

    from plait.model import Transformer
    from plait.parallel.tensor.loss import vocab_parallel_loss
    from plait.parallel.tensor.sharding_plan import apply_tensor_parallel

    mesh = ctx.mesh(tp=ctx.world_size)
    model = Transformer(CFG, seed=0)
    apply_tensor_parallel(model, mesh, sequence_parallel=sp)
    loss_fn = vocab_parallel_loss(mesh, CFG.vocab_size)
    fixed = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in fixed:
            seen[st.data_ptr()] = st.nbytes()
        return t

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CFG.vocab_size, (batch, seq), generator=g)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model(x), x)
    loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_activations_are_exact(
    pools: Callable[[int], WorkerPool], sp: bool
) -> None:
    batch, seq = 2, 16
    got = pools(2).run(f"{M}:_body_saved", sp, batch, seq)
    spec = ModelSpec.from_config(CFG)
    lay = Layout(tp=2, micro_batch=batch, sequence_parallel=sp)
    mem = memory_per_rank(query(spec, lay, PRECISIONS["fp32"], RUNTIMES["plait"], seq), lay)
    assert got == [mem.activations + mem.embedding_head] * 2
