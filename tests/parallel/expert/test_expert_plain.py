"""A model of the user's own (no ``cfg``, no ``layers`` list) holding plait's MoE.

Expert parallelism finds the MoE layers by scanning the modules, so the layout check
counts their experts the same way: ep2 on such a model matches one process (float64).
Tensor parallelism has no plan for it: a ConfigError naming ``plait_tp_plan``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from plait.config import ParallelConfig
from plait.errors import ConfigError
from plait.model.moe import MoE
from plait.optim import Optimizer
from plait.parallel.expert.tp_plan import moe_tp_plan
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext
from tests.parallel.expert.test_expert_parallel import BATCH, MOE, VOCAB, _batches
from tests.parallel.test_parallelize import CLIP, LR, RTOL, Pools, train_one_process


class Plain(nn.Module):
    """Embedding, one MoE feed-forward (residual), output head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.embed = nn.Embedding(VOCAB, MOE.dim)
        self.moe = MoE(MOE)
        self.head = nn.Linear(MOE.dim, VOCAB, bias=False)
        with torch.no_grad():  # the expert weights are allocated uninitialized
            for p in self.parameters():
                p.normal_(0.0, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(h + self.moe(h))


def _model() -> Plain:
    return Plain().double()


def _plain(ctx: WorkerContext) -> dict[str, Any]:
    mesh = ctx.mesh(dp=ctx.world_size)
    pm = parallelize(_model(), mesh, ParallelConfig(ep=2, bucket_mb=0.01))
    assert pm.experts is not None and pm.experts.ep == 2
    opt = Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=LR), max_norm=CLIP)
    per, r = BATCH // ctx.world_size, mesh.index("dp")
    losses, norms = [], []
    for x, y in _batches():
        losses.append(float(pm.step(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])))
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
    return {"losses": losses, "norms": norms}


def test_plain_model_with_moe_under_ep_matches_one_process(pools: Pools) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = train_one_process(model, opt, _batches(), VOCAB)
    for res in pools(2).run("tests.parallel.expert.test_expert_plain:_plain"):
        torch.testing.assert_close(res["losses"], losses, rtol=RTOL, atol=0)
        torch.testing.assert_close(res["norms"], norms, rtol=RTOL, atol=0)


def test_tp_plan_of_a_plain_moe_model_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="plait_tp_plan"):
        moe_tp_plan(_model())
