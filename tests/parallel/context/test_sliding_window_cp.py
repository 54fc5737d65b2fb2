"""Sliding windows and restarted positions across ranks against one process (float64).

Ring (zigzag) and all-to-all attention at cp2 with a window, with and without document
masks, equal the dense masked reference (outputs and q/k/v gradients, 1e-10) and differ
from the windowless result, with no host-syncing op in the ring's forward and backward;
the ring's host plan skips a step whose keys are all outside the window; packed samples
with restarted (global) positions under cp2 lose what each sample loses alone; five
training steps of a model alternating sliding and full layers under cp2 ring, cp2
all-to-all, tp2 + sequence parallelism, pp2 and dp2 equal one process.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plait.config import ModelConfig, ParallelConfig
from plait.model import Transformer
from plait.model.document_mask import DocumentIds
from plait.optim import Optimizer
from plait.parallel.context.context_parallel import apply_context_parallel
from plait.parallel.context.layout import shard_sequence, unshard_sequence
from plait.parallel.context.ring_attention import RingAttention
from plait.parallel.context.ulysses_attention import UlyssesAttention
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext
from tests.model.test_sliding_window import (
    CFG,
    EOS,
    SAMPLES,
    TOL,
    CountSyncs,
    W,
    _inputs,
    alone_losses,
    dense_attention,
    packed_batch,
    sample_losses,
)
from tests.parallel.test_parallelize import CLIP, LR, Pools, train_one_process

CASES = [("ring", False), ("ring", True), ("ulysses", False), ("ulysses", True)]


def _attention(ctx: WorkerContext, attn: str, with_docs: bool) -> dict[str, Any]:
    mesh = ctx.mesh(dp=1, cp=ctx.world_size)
    cp, me = mesh.size("cp"), mesh.index("cp")
    group = mesh.axis("cp")
    core = RingAttention(group, window=W) if attn == "ring" else UlyssesAttention(group, window=W)
    lay = "zigzag" if attn == "ring" else "contiguous"
    q, k, v, dout, docs = _inputs()
    q, k, v, dout = (shard_sequence(t, lay, cp, me, dim=2) for t in (q, k, v, dout))  # type: ignore[arg-type]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with CountSyncs() as mode:
        out = core(q, k, v, docs) if with_docs else core(q, k, v)
        out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "syncs": mode.count}


@pytest.mark.parametrize(("attn", "with_docs"), CASES)
def test_cp_window_equals_dense_reference(pools: Pools, attn: str, with_docs: bool) -> None:
    """cp2: the window in global positions, documents or not, equals the dense masked
    reference; the ring runs no ``.item()``/``nonzero``/``bool()`` forward or backward."""
    results = pools(2).run(_attention, attn, with_docs)
    q, k, v, dout, docs_all = _inputs()
    docs = docs_all if with_docs else None
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = dense_attention(q, k, v, docs, W)
    ref.backward(dout)
    lay = "zigzag" if attn == "ring" else "contiguous"
    for name, want in (("out", ref), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        got = unshard_sequence([r[name] for r in results], lay, dim=2)  # type: ignore[arg-type]
        torch.testing.assert_close(got, want.detach(), **TOL, msg=name)
    unwindowed = dense_attention(q.detach(), k.detach(), v.detach(), docs, None)
    assert (ref.detach() - unwindowed).abs().max() > 1e-3
    if attn == "ring":
        assert all(r["syncs"] == {} for r in results)


def test_ring_plan_skips_steps_outside_the_window() -> None:
    """cp4, 32 tokens in chunks of 4, window 4: rank 3 (chunks 3, 4) against the blocks
    of ranks 0 (chunks 0, 7) and 1 (1, 6) sees nothing (skipped steps); against rank 2's
    (chunks 2, 5) only the band of chunk 3 over chunk 2, masked; its own block is one
    masked call (chunk 4 sees only part of chunk 3)."""
    ring = RingAttention.__new__(RingAttention)
    ring.__dict__.update(
        group=SimpleNamespace(size=4, index=3), causal=True, layout="zigzag", window=4
    )
    plan = [RingAttention.plan(ring, src, 8, None) for src in range(4)]
    assert plan[0] == plan[1] == []
    assert plan[2] == [(slice(0, 4), slice(0, 4), "masked")]
    assert plan[3] == [(slice(0, 8), slice(0, 8), "masked")]
    ring.window = None  # no window: the own block is one causal call, rank 0's is full
    assert RingAttention.plan(ring, 3, 8, None) == [(slice(0, 8), slice(0, 8), "causal")]
    assert RingAttention.plan(ring, 0, 8, None) == [(slice(0, 8), slice(0, 4), "full")]


def _packed(ctx: WorkerContext, attn: str) -> torch.Tensor:
    """Logits of the packed window with restarted positions on a cp2 mesh (this rank's)."""
    mesh = ctx.mesh(dp=1, cp=ctx.world_size)
    model = Transformer(_packed_cfg(), seed=4).double()
    model.documents = DocumentIds(EOS, restart_positions=True)
    layout = apply_context_parallel(model, mesh, attn)  # type: ignore[arg-type]
    tokens, _, _ = packed_batch()
    return model(layout.shard(tokens)).detach()


def _packed_cfg() -> ModelConfig:
    return ModelConfig(**{**CFG.__dict__, "sliding_window": None, "layer_types": None})


@pytest.mark.parametrize("attn", ["ring", "ulysses"])
def test_packed_samples_under_cp_equal_each_alone(pools: Pools, attn: str) -> None:
    """cp2: positions restart at each sample in global positions (a sample crosses the
    ranks' chunks): each sample's summed loss equals its loss alone (rtol 1e-9)."""
    parts = pools(2).run(_packed, attn)
    lay = "zigzag" if attn == "ring" else "contiguous"
    logits = unshard_sequence(parts, lay, dim=1)  # type: ignore[arg-type]
    _, targets, samples = packed_batch()
    model = Transformer(_packed_cfg(), seed=4).double()
    assert len(samples) == len(SAMPLES)
    assert sample_losses(logits, targets) == pytest.approx(alone_losses(model, samples), rel=1e-9)


STEPS, BATCH, SEQ, VOCAB = 5, 4, 16, 32
TRAIN_CFG = ModelConfig(
    **{**CFG.__dict__, "vocab_size": VOCAB, "layer_types": ("sliding_attention", "full_attention")}
)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _train(
    ctx: WorkerContext, dp: int, cp: int, tp: int, pp: int, attn: str, sp: bool
) -> dict[str, Any]:
    mesh = ctx.mesh(dp=dp, tp=tp, pp=pp, cp=cp)
    cfg = ParallelConfig(microbatches=2, pipeline_schedule="1f1b", cp_attention=attn)  # type: ignore[arg-type]
    pm = parallelize(Transformer(TRAIN_CFG, seed=3).double(), mesh, cfg, sequence_parallel=sp)
    windows = [getattr(m, "window", None) for m in pm.modules() if hasattr(m, "window")]
    opt = Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=LR), max_norm=CLIP)
    per, r = BATCH // dp, mesh.index("dp")
    losses, norms = [], []
    for x, y in _batches():
        losses.append(float(pm.step(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])))
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "windows": windows}


LAYOUTS = [
    # (dp, cp, tp, pp, cp attention, sequence parallel)
    pytest.param(1, 2, 1, 1, "ring", False, id="cp2-ring"),
    pytest.param(1, 2, 1, 1, "ulysses", False, id="cp2-ulysses"),
    pytest.param(1, 1, 2, 1, "ring", True, id="tp2-sp"),
    pytest.param(1, 1, 1, 2, "ring", False, id="pp2"),
    pytest.param(2, 1, 1, 1, "ring", False, id="dp2"),
]


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], list[float]]:
    model = Transformer(TRAIN_CFG, seed=3).double()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return train_one_process(model, opt, _batches(), VOCAB)


@pytest.mark.parametrize(("dp", "cp", "tp", "pp", "attn", "sp"), LAYOUTS)
def test_windowed_training_matches_one_process(
    pools: Pools,
    reference: tuple[list[float], list[float]],
    dp: int,
    cp: int,
    tp: int,
    pp: int,
    attn: str,
    sp: bool,
) -> None:
    """Five AdamW steps (clipped) of the alternating model: losses and pre-clip norms
    on every rank equal one process (rtol 1e-10); the window survives each layout and
    changes the loss."""
    losses, norms = reference
    results = pools(2).run(_train, dp, cp, tp, pp, attn, sp)
    assert W in [w for r in results for w in r["windows"]]  # pp2: on the first stage
    for r in results:
        assert r["losses"] == pytest.approx(losses, rel=1e-10)
        assert r["norms"] == pytest.approx(norms, rel=1e-10)
    windowless = ModelConfig(**{**TRAIN_CFG.__dict__, "sliding_window": None, "layer_types": None})
    m = Transformer(windowless, seed=3).double()
    first = F.cross_entropy(m(_batches()[0][0]).reshape(-1, VOCAB), _batches()[0][1].reshape(-1))
    assert abs(float(first) - losses[0]) > 1e-6  # the window changes the loss
