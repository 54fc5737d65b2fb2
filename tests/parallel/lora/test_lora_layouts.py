"""LoRA under every layout equals one process running the whole global batch.

Reference: plain PyTorch on one process — plait's one-device ``Transformer`` with
adapters attached by :func:`plait.parallel.lora.apply_lora` (forward hooks on its
``nn.Linear`` layers), ``F.cross_entropy`` over the global batch, ``clip_grad_norm_``
over the adapters and ``torch.optim.AdamW`` over them, in float64, from the same seed
and batches. Each layout runs ``parallelize(..., lora=...)`` and plait's ``Optimizer``
on its ranks (each dp rank feeds its slice of the global batch). Compared:

* the global-batch loss at every step on every rank, and the pre-clip gradient norm
  (clipping engaged), rtol 1e-9;
* every adapter factor after ``STEPS`` steps, rebuilt from ``local_pieces()`` (rtol
  1e-9, atol 1e-12): so the replicated factor's gradient sum over tp, the norm weight of
  a replicated factor and the ZeRO shards of the adapters are all checked;
* every base weight, rebuilt the same way, bit-equal to its initial value (frozen).

Tolerances: float64 everywhere; the layouts differ only in summation order (<= 1e-13
relative, measured), so any real error (a factor's missing gradient sum: a factor 2)
is far above 1e-9.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plait.config import LoraConfig, ModelConfig, ParallelConfig
from plait.model import Transformer
from plait.model.init import SEED_ATTR
from plait.optim import Optimizer
from plait.parallel.lora import apply_lora
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext, WorkerPool
from tests.parallel.test_parallelize import assemble

Pools = Callable[[int], WorkerPool]
STEPS, BATCH, SEQ, VOCAB, DIM, LR, CLIP = 5, 4, 8, 64, 32, 1e-2, 0.05
RTOL, ATOL = 1e-9, 1e-12
CFG = ModelConfig(vocab_size=VOCAB, dim=DIM, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
LORA = LoraConfig(rank=4, alpha=8.0, targets="q,k,v,o,gate,up,down")


def _model() -> Transformer:
    """The one-device transformer (2 layers, GQA 4:2), float64, seed 3 (also the
    adapters' seed: ``parallelize`` reads it from the model)."""
    model = Transformer(CFG, seed=3).double()
    setattr(model, SEED_ATTR, 3)
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` global batches of (tokens, targets), ``(BATCH, SEQ)`` each."""
    g = torch.Generator().manual_seed(11)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _trained(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    """The one-process run: losses, pre-clip norms, every weight after the last step."""
    model = _model()
    apply_lora(model, LORA, seed=3)
    opt = torch.optim.AdamW(_trained(model), lr=LR)
    losses, norms = [], []
    for x, y in _batches():
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(_trained(model), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights}


def _body(ctx: WorkerContext, dp: int, tp: int, pp: int, cp: int, zero: int) -> dict[str, Any]:
    """The user's loop with LoRA on one rank: losses, norms, written pieces."""
    mesh = ctx.mesh(dp=dp, tp=tp, pp=pp, cp=cp)
    cfg = ParallelConfig(microbatches=2, pipeline_schedule="1f1b", bucket_mb=0.001)
    pm = parallelize(_model(), mesh, cfg, zero=zero, lora=LORA)
    opt = Optimizer(pm, torch.optim.AdamW(_trained(pm), lr=LR), max_norm=CLIP)
    per, r = BATCH // dp, mesh.index("dp")
    losses, norms = [], []
    for x, y in _batches():
        xr, yr = x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]
        losses.append(float(pm.step(xr, yr, micro_batches=2 if pp == 1 else 1)))
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
    pieces = [
        (p.name, list(p.shape), p.tp, p.start, p.end, p.value.detach().cpu().clone())
        for p in opt.local_pieces()
        if p.write
    ]
    return {"losses": losses, "norms": norms, "pieces": pieces}


LAYOUTS = [  # (dp, tp, pp, cp, zero)
    pytest.param(2, 1, 1, 1, 0, id="dp2"),
    pytest.param(2, 1, 1, 1, 1, id="zero1-dp2"),
    pytest.param(2, 1, 1, 1, 2, id="zero2-dp2"),
    pytest.param(2, 1, 1, 1, 3, id="zero3-dp2"),
    pytest.param(1, 2, 1, 1, 0, id="tp2"),
    pytest.param(1, 1, 2, 1, 0, id="pp2"),
    pytest.param(1, 1, 1, 2, 0, id="cp2"),
]


@pytest.mark.parametrize(("dp", "tp", "pp", "cp", "zero"), LAYOUTS)
def test_lora_matches_one_process(
    pools: Pools, ref: dict[str, Any], dp: int, tp: int, pp: int, cp: int, zero: int
) -> None:
    """Losses and norms every step (rtol 1e-9), adapters after ``STEPS`` steps (rtol
    1e-9), base weights bit-unchanged, under the layout."""
    assert min(ref["norms"]) > CLIP  # clipping engaged at every step
    results = pools(dp * tp * pp * cp).run(_body, dp, tp, pp, cp, zero)
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(ref["losses"], rel=RTOL), f"rank {rank} losses"
        assert r["norms"] == pytest.approx(ref["norms"], rel=RTOL), f"rank {rank} norms"
    got = assemble([p for r in results for p in r["pieces"]])
    assert sorted(set(got) - set(ref["weights"])) == []  # every one-device name, once
    assert sorted(set(ref["weights"]) - set(got)) == []
    start = dict(_model().named_parameters())
    for name, want in ref["weights"].items():
        if ".lora_" in name:
            torch.testing.assert_close(got[name], want, rtol=RTOL, atol=ATOL, msg=name)
        else:
            assert torch.equal(got[name], start[name].detach()), f"{name} changed"
