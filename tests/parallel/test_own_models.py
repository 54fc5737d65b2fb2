"""Models plait did not write, under dp2, ZeRO-3 and tp2, against one process.

Two models, both built the way ``plait train`` builds them
(:func:`plait.model.factory.build_model`, then ``.double()``):

* ``factory``: a GPT-2-style model from ``model.factory =
  "tests.model.factory_models:build"`` that carries its own plan (``plait_tp_plan``);
* ``hf-llama``: ``model.family = "hf-llama"``, transformers' ``LlamaForCausalLM``
  (4 heads, 2 key/value heads; random init), which returns an output object (the loss
  reads its ``.logits``), is cut by the shipped plan ``HF_LLAMA_TP_PLAN`` and calls its
  attention region by keyword (``self_attn(hidden_states=...)``); and ``hf-llama-mqa``
  (one key/value head, so under tp2 it is replicated and the attention's
  ``num_key_value_groups`` must be the per-rank 2, not 4; with eager attention, which
  repeats K/V by that number, where sdpa would infer it from the shapes); and
  ``hf-llama-tied`` (``lm_head`` shares the embedding matrix: one vocabulary shard).

The reference is the plain PyTorch loop on one process over the whole global batch
(``model(x)``, its logits, ``F.cross_entropy``, ``clip_grad_norm_``, AdamW), float64.
Compared, as in ``tests/parallel/test_parallelize.py`` (whose reasoning on tolerances
applies: layouts differ only in summation order): the loss and the pre-clip gradient
norm at every one of 5 steps on every rank (rtol 1e-9) and every weight after the 5th
step, rebuilt from the pieces the ranks write (rtol 1e-9, atol 1e-11).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig
from plait.errors import ConfigError
from plait.model.factory import build_model, logits_of
from plait.optim import Optimizer
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext, WorkerPool
from tests.parallel.test_parallelize import Piece, assemble

pytest.importorskip("transformers")

Pools = Callable[[int], WorkerPool]
STEPS, BATCH, SEQ, VOCAB, LR, CLIP = 5, 8, 16, 64, 1e-2, 0.5
RTOL, ATOL = 1e-9, 1e-11
SIZES = {"vocab_size": VOCAB, "dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": SEQ}
CONFIGS = {
    "factory": ModelConfig(**SIZES, factory="tests.model.factory_models:build"),
    "hf-llama": ModelConfig(**SIZES, n_kv_heads=2, family="hf-llama"),
    "hf-llama-mqa": ModelConfig(**SIZES, n_kv_heads=1, family="hf-llama"),
    "hf-llama-tied": ModelConfig(**SIZES, tie_embeddings=True, family="hf-llama"),
}


def _model(kind: str) -> nn.Module:
    model = build_model(CONFIGS[kind], seed=3).double()
    if kind == "hf-llama-mqa":  # eager attention repeats K/V by num_key_value_groups
        model.config._attn_implementation = "eager"  # (sdpa infers it from the shapes)
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _reference(kind: str) -> dict[str, Any]:
    model = _model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses: list[float] = []
    norms: list[float] = []
    for x, y in _batches():
        loss = F.cross_entropy(logits_of(model(x)).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights}


def _body(ctx: WorkerContext, kind: str, dp: int, tp: int, zero: int) -> dict[str, Any]:
    mesh = ctx.mesh(dp=dp, tp=tp)
    pm = parallelize(_model(kind), mesh, zero=zero)
    opt = Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=LR), max_norm=CLIP)
    per, r = BATCH // dp, mesh.index("dp")
    losses: list[float] = []
    norms: list[float] = []
    for x, y in _batches():
        xr, yr = x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]
        losses.append(float(pm.step(xr, yr)))
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
    pieces: list[Piece] = [
        (p.name, list(p.shape), p.tp, p.start, p.end, p.value.detach().cpu().clone())
        for p in opt.local_pieces()
        if p.write
    ]
    return {"losses": losses, "norms": norms, "pieces": pieces}


@pytest.fixture(scope="module")
def refs() -> dict[str, dict[str, Any]]:
    return {kind: _reference(kind) for kind in CONFIGS}


LAYOUTS = [
    # (model, dp, tp, zero)
    pytest.param("factory", 2, 1, 0, id="factory-dp2"),
    pytest.param("factory", 2, 1, 3, id="factory-zero3-dp2"),
    pytest.param("factory", 1, 2, 0, id="factory-tp2"),
    pytest.param("hf-llama", 2, 1, 0, id="hf-llama-dp2"),
    pytest.param("hf-llama", 2, 1, 3, id="hf-llama-zero3-dp2"),
    pytest.param("hf-llama", 1, 2, 0, id="hf-llama-tp2"),
    pytest.param("hf-llama-mqa", 1, 2, 0, id="hf-llama-mqa-tp2-kv-replicated"),
    pytest.param("hf-llama-tied", 1, 2, 0, id="hf-llama-tied-embeddings-tp2"),
]


@pytest.mark.parametrize(("kind", "dp", "tp", "zero"), LAYOUTS)
def test_own_model_matches_one_process(
    pools: Pools, refs: dict[str, dict[str, Any]], kind: str, dp: int, tp: int, zero: int
) -> None:
    ref = refs[kind]
    results = pools(2).run(_body, kind, dp, tp, zero)
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(ref["losses"], rel=RTOL), f"rank {rank} losses"
        assert r["norms"] == pytest.approx(ref["norms"], rel=RTOL), f"rank {rank} norms"
    got = assemble([p for r in results for p in r["pieces"]])
    assert sorted(got) == sorted(ref["weights"])  # the model's own names, each once
    for name, want in ref["weights"].items():
        torch.testing.assert_close(got[name], want, rtol=RTOL, atol=ATOL, msg=name)


def _body_pipeline(ctx: WorkerContext) -> str:
    mesh = ctx.mesh(dp=1, pp=2)
    try:
        parallelize(_model("hf-llama"), mesh)
    except ConfigError as e:
        return str(e)
    return "accepted"


def test_pipeline_split_refuses_hf_llama_by_name(pools: Pools) -> None:
    for text in pools(2).run(_body_pipeline):
        assert "LlamaForCausalLM" in text and "pipeline" in text
