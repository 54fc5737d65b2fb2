"""A user's own training loop, written only with ``parallelize`` and ``plait.optim``.

The loop every layout runs (each dp rank feeds its contiguous slice of the global batch;
the ranks of one replica feed the same slice)::

    pm = parallelize(model, mesh, cfg, zero=...)
    opt = Optimizer(pm, torch.optim.AdamW(model.parameters(), lr=LR), max_norm=CLIP)
    for x, y in batches:
        loss = pm.step(x_slice, y_slice, micro_batches=k); opt.step(); opt.zero_grad()

Reference: plain PyTorch on one process over the whole global batch (``model(x)``,
``F.cross_entropy``, ``clip_grad_norm_``, ``torch.optim.AdamW``), from the same seed, in
float64. Compared: the global-batch loss ``pm.step`` returns at every step (rtol 1e-9)
and every weight after STEPS steps (rtol 1e-9, atol 1e-11: summation order only),
rebuilt from the pieces the ranks describe through ``Optimizer.local_pieces()`` — so the
checkpoint protocol is checked too (every one-device tensor covered exactly once).
Models: plait's built-in transformer (dp2, ZeRO-3 dp2, tp2, pp2, dp2×tp2×pp2 with
ZeRO-1) and a ``torch.nn.TransformerEncoder`` model (dp2 with accumulation, ZeRO-3 dp2;
pp and tp need structure it lacks and are refused by name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig, ParallelConfig
from plait.errors import ConfigError
from plait.model import Transformer
from plait.optim import Optimizer
from plait.parallel.parallelize import parallelize
from plait.pieces import TPSplit
from plait.testing import WorkerContext, WorkerPool

Pools = Callable[[int], WorkerPool]
STEPS, BATCH, SEQ, VOCAB, LR, CLIP = 5, 8, 16, 64, 1e-2, 0.5
RTOL, ATOL = 1e-9, 1e-11
CFG = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)


def _builtin() -> nn.Module:
    return Transformer(CFG, seed=3).double()


def _encoder() -> nn.Module:
    torch.manual_seed(5)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.Sequential(
        nn.Embedding(VOCAB, 32), nn.TransformerEncoder(layer, 2), nn.Linear(32, VOCAB)
    )
    return model.double()


MODELS: dict[str, Callable[[], nn.Module]] = {"builtin": _builtin, "encoder": _encoder}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),  # (batch, seq) tokens
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),  # (batch, seq) targets
        )
        for _ in range(STEPS)
    ]


def _reference(kind: str) -> dict[str, Any]:
    model = MODELS[kind]()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for x, y in _batches():
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights}


def _body(
    ctx: WorkerContext, kind: str, dp: int, tp: int, pp: int, zero: int, micro: int
) -> dict[str, Any]:
    mesh = ctx.mesh(dp=dp, tp=tp, pp=pp)
    model = MODELS[kind]()
    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, microbatches=4, bucket_mb=0.01)
    pm = parallelize(model, mesh, cfg, zero=zero)
    opt = Optimizer(pm, torch.optim.AdamW(model.parameters(), lr=LR), max_norm=CLIP)
    per, r = BATCH // dp, mesh.index("dp")
    losses, norms = [], []
    for x, y in _batches():
        loss = pm.step(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per], micro_batches=micro)
        losses.append(float(loss))
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
    pieces = [
        (p.name, p.shape, p.tp, p.start, p.end, p.value.detach().cpu().clone())
        for p in opt.local_pieces()
        if p.write
    ]
    return {"losses": losses, "norms": norms, "pieces": pieces}


Piece = tuple[str, list[int], TPSplit | None, int, int, torch.Tensor]


def assemble(pieces: list[Piece]) -> dict[str, torch.Tensor]:
    """One-device tensors from every rank's written pieces, each element written exactly
    once: a piece's ``start:end`` indexes the flattened block its rank holds (the whole
    tensor, or tp block ``index // replicas`` along ``dim`` of the zero-padded tensor)."""
    shapes: dict[str, list[int]] = {}
    blocks: dict[tuple[str, int], tuple[TPSplit | None, torch.Tensor, torch.Tensor]] = {}
    for name, shape, tp, start, end, value in pieces:
        shapes[name] = shape
        local = tp.local_shape(tuple(shape)) if tp is not None else tuple(shape)
        key = (name, tp.index // tp.replicas if tp is not None else 0)
        if key not in blocks:
            numel = torch.Size(local).numel()
            blocks[key] = (tp, torch.zeros(numel, dtype=value.dtype), torch.zeros(numel))
        _, flat, seen = blocks[key]
        flat[start:end] = value
        seen[start:end] += 1
    out: dict[str, torch.Tensor] = {}
    for (name, block), (tp, flat, seen) in blocks.items():
        assert bool((seen == 1).all()), f"{name}: elements written {seen.unique()} times"
        shape = shapes[name]
        if tp is None:
            out[name] = flat.view(shape)
            continue
        if name not in out:
            padded = list(shape)
            padded[tp.dim] = tp.shards * tp.block  # (..., shards * block, ...)
            out[name] = torch.zeros(padded, dtype=flat.dtype)
        local = flat.view(tp.local_shape(tuple(shape)))
        out[name].narrow(tp.dim, block * tp.block, tp.block).copy_(local)
    for name, tensor in out.items():  # drop the tp padding (vocabulary rows)
        for dim, full in enumerate(shapes[name]):
            tensor = tensor.narrow(dim, 0, full)
        out[name] = tensor
    return out


@pytest.fixture(scope="module")
def refs() -> dict[str, dict[str, Any]]:
    return {kind: _reference(kind) for kind in MODELS}


LAYOUTS = [
    # (model, world, dp, tp, pp, zero, micro-batches per step)
    pytest.param("builtin", 2, 2, 1, 1, 0, 2, id="builtin-dp2-accum2"),
    pytest.param("builtin", 2, 2, 1, 1, 3, 1, id="builtin-zero3-dp2"),
    pytest.param("builtin", 2, 1, 2, 1, 0, 1, id="builtin-tp2"),
    pytest.param("builtin", 2, 1, 1, 2, 0, 1, id="builtin-pp2"),
    pytest.param("builtin", 8, 2, 2, 2, 1, 1, id="builtin-dp2xtp2xpp2-zero1"),
    pytest.param("encoder", 2, 2, 1, 1, 0, 2, id="encoder-dp2-accum2"),
    pytest.param("encoder", 2, 2, 1, 1, 3, 1, id="encoder-zero3-dp2"),
]


@pytest.mark.parametrize(("kind", "world", "dp", "tp", "pp", "zero", "micro"), LAYOUTS)
def test_own_loop_matches_one_process(
    pools: Pools,
    refs: dict[str, dict[str, Any]],
    kind: str,
    world: int,
    dp: int,
    tp: int,
    pp: int,
    zero: int,
    micro: int,
) -> None:
    ref = refs[kind]
    assert min(ref["norms"]) > CLIP  # clipping is engaged at every step
    results = pools(world).run(_body, kind, dp, tp, pp, zero, micro)
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=RTOL)
        assert r["norms"] == pytest.approx(ref["norms"], rel=RTOL)
    got = assemble([p for r in results for p in r["pieces"]])
    assert set(got) == set(ref["weights"])
    for name, want in ref["weights"].items():
        torch.testing.assert_close(got[name], want, rtol=RTOL, atol=ATOL, msg=name)


def _body_refused(ctx: WorkerContext, tp: int, pp: int) -> str:
    mesh = ctx.mesh(dp=1, tp=tp, pp=pp)
    try:
        parallelize(_encoder(), mesh)
    except ConfigError as e:
        return str(e)
    return "accepted"


def test_structure_a_model_lacks_is_refused_by_name(pools: Pools) -> None:
    pp_msgs = pools(2).run(_body_refused, 1, 2)
    assert all("pipeline split: the model has no 'tok_embeddings'" in m for m in pp_msgs)
    tp_msgs = pools(2).run(_body_refused, 2, 1)
    assert all("tensor-parallel plan" in m and "matches no module" in m for m in tp_msgs)
