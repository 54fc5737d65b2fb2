"""A tensor-parallel plan on a model plait did not write, whose region is called with
keyword arguments (``self.mlp(hidden_states=h)``, as Hugging Face modules are called).

tp2 vs one process, float64: the loss of 3 SGD steps (rtol 1e-10) and the gathered
weights after them (rtol 1e-10, atol 1e-12). Before the region hook accepted keyword
calls this failed with ``IndexError: tuple index out of range``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.parallel.parallelize import parallelize
from plait.parallel.tensor.sharding_plan import gather_full_state
from plait.testing import WorkerContext, WorkerPool

VOCAB, DIM, HID, SEQ, BATCH, STEPS = 32, 16, 64, 8, 4, 3
PLAN = (
    ("emb", "vocab_embedding"),
    ("mlp", "region"),
    ("mlp.up", "colwise"),
    ("mlp.down", "rowwise"),
    ("head", "vocab_head"),
)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HID, bias=False)
        self.down = nn.Linear(HID, DIM, bias=False)

    def forward(self, hidden_states: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.down(F.gelu(self.up(hidden_states))) * scale  # (batch, seq, dim)


class KwargsLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mlp = MLP()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)  # (batch, seq, dim)
        h = h + self.mlp(hidden_states=h, scale=0.5)  # the region, called by keyword
        return self.head(h)  # (batch, seq, vocab)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _body(ctx: WorkerContext | None) -> dict[str, object]:
    from plait import init_mesh

    mesh = ctx.mesh(tp=ctx.world_size) if ctx is not None else init_mesh()
    model = KwargsLM().double()
    pm = parallelize(model, mesh, tp_plan=PLAN)
    opt = torch.optim.SGD(pm.parameters(), lr=0.5)
    x, y = _data()
    losses = []
    for _ in range(STEPS):
        losses.append(float(pm.step(x, y)))
        opt.step()
        opt.zero_grad()
    weights = (
        gather_full_state(model, mesh)
        if mesh.size("tp") > 1
        else {n: p.detach().clone() for n, p in model.named_parameters()}
    )
    return {"losses": losses, "weights": weights}


def test_region_called_by_keyword_matches_one_process(
    pools: Callable[[int], WorkerPool],
) -> None:
    ref = _body(None)
    for r in pools(2).run(_body):
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-10)
        for n, w in ref["weights"].items():  # type: ignore[union-attr]
            torch.testing.assert_close(r["weights"][n], w, rtol=1e-10, atol=1e-12)
