"""A user's own training loop, written only with ``parallelize`` and ``plait.optim``.

The loop every layout runs on every rank (each dp rank feeds its contiguous slice of the
global batch; the tp and pp ranks of one dp replica feed the same slice)::

    pm = parallelize(model, mesh, ParallelConfig(microbatches=4), zero=...)
    opt = Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=LR), max_norm=CLIP)
    for x, y in batches:
        loss = pm.step(x_slice, y_slice, micro_batches=k); opt.step(); opt.zero_grad()

Reference: plain PyTorch on one process over the whole global batch (``model(x)``,
``F.cross_entropy``, ``clip_grad_norm_``, ``torch.optim.AdamW``), from the same seed and
the same batches, in float64 — so this also checks that plait's step *is* the plain
PyTorch step. Compared:

* the global-batch mean loss ``pm.step`` returns, at every step, on every rank
  (rtol 1e-9);
* the global gradient norm ``opt.step()`` reports before clipping, at every step, on
  every rank (rtol 1e-9; clipping is engaged at every step of the reference);
* every weight after ``STEPS`` steps (rtol 1e-9, atol 1e-11), rebuilt from the pieces
  the ranks describe through ``Optimizer.local_pieces()`` — so the checkpoint protocol
  is checked too: every element of every one-device tensor is written exactly once, and
  the names are exactly the reference's ``named_parameters()``.

Why these tolerances: everything runs in float64 and the layouts differ from the
reference only in summation order (micro-batch and dp averaging, tp partial sums,
sharded norms); measured, that moves losses and norms by <= 6e-16 relative and weights
by <= 1e-13, so 1e-9 leaves a wide margin while any real error (a missing 1/k, an
element counted twice, a wrong clip) is >= 1e-3. The atol is for the key part of
``nn.MultiheadAttention``'s ``in_proj_bias``: its exact gradient is zero (softmax ignores
a constant added to every score of a query), so its values are rounding noise that
AdamW scales by lr / eps — about 1e-12 after 5 steps, in the reference and in every
layout alike.

Layouts: plait's built-in transformer — dp2 (2 micro-batches), ZeRO-3 dp2 (2
micro-batches), tp2, pp2 (1F1B, 4 micro-batches), dp2×tp2×pp2 with plain data
parallelism and with ZeRO-1 — and a ``torch.nn.TransformerEncoder`` model — dp2 (2
micro-batches), ZeRO-1/2/3 dp2. The encoder lacks the structure the pipeline split and
the default tensor-parallel plan need; those are refused by name.
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
STEPS, BATCH, SEQ, VOCAB, DIM, LR, CLIP = 5, 8, 16, 64, 32, 1e-2, 0.5
RTOL, ATOL = 1e-9, 1e-11
PIPELINE_MICROBATCHES = 4
CFG = ModelConfig(vocab_size=VOCAB, dim=DIM, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)

Piece = tuple[str, list[int], TPSplit | None, int, int, torch.Tensor]
"""A written piece as a rank returns it: (name, global shape, tp block, start, end,
values) — the fields of :class:`plait.pieces.LocalPiece` that locate and fill it."""


def _builtin() -> nn.Module:
    """plait's built-in transformer (4 layers, GQA 4:2 heads), float64, seed 3."""
    return Transformer(CFG, seed=3).double()


def _encoder() -> nn.Module:
    """A user's own model: embedding, ``nn.TransformerEncoder`` (2 layers), head; float64."""
    torch.manual_seed(5)
    layer = nn.TransformerEncoderLayer(DIM, 4, 64, dropout=0.0, batch_first=True)
    model = nn.Sequential(
        nn.Embedding(VOCAB, DIM), nn.TransformerEncoder(layer, 2), nn.Linear(DIM, VOCAB)
    )
    return model.double()


MODELS: dict[str, Callable[[], nn.Module]] = {"builtin": _builtin, "encoder": _encoder}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` global batches of (tokens, targets), each ``(BATCH, SEQ)`` int64, from a
    seeded generator: the same on every rank and in the reference."""
    g = torch.Generator().manual_seed(11)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def train_one_process(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    vocab: int,
) -> tuple[list[float], list[float]]:
    """The plain-PyTorch loop every parity test compares with: cross-entropy of the whole
    batch, backward, clipping at CLIP, a step. Returns the losses and the pre-clip norms."""
    losses: list[float] = []
    norms: list[float] = []
    for x, y in batches:
        loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _reference(kind: str) -> dict[str, Any]:
    """The plain-PyTorch loop on one process: losses and pre-clip norms per step, and
    the weights after the last step."""
    model = MODELS[kind]()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = train_one_process(model, opt, _batches(), VOCAB)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights}


def _body(
    ctx: WorkerContext, kind: str, dp: int, tp: int, pp: int, zero: int, micro: int
) -> dict[str, Any]:
    """The user's loop on one rank; returns its losses, norms and written pieces."""
    mesh = ctx.mesh(dp=dp, tp=tp, pp=pp)
    cfg = ParallelConfig(
        microbatches=PIPELINE_MICROBATCHES,
        pipeline_schedule="1f1b",
        bucket_mb=0.01,  # several data-parallel buckets even for these tiny models
    )
    pm = parallelize(MODELS[kind](), mesh, cfg, zero=zero)
    opt = Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=LR), max_norm=CLIP)
    per, r = BATCH // dp, mesh.index("dp")
    losses: list[float] = []
    norms: list[float] = []
    for x, y in _batches():
        xr, yr = x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]
        if pp > 1 and not losses:
            with pytest.raises(RuntimeError, match=r"ParallelModel\.step"):
                pm(xr)  # the schedule drives every stage: forward() is refused
        losses.append(float(pm.step(xr, yr, micro_batches=micro)))
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
    pieces: list[Piece] = [
        (p.name, list(p.shape), p.tp, p.start, p.end, p.value.detach().cpu().clone())
        for p in opt.local_pieces()
        if p.write
    ]
    return {"losses": losses, "norms": norms, "pieces": pieces}


def assemble(pieces: list[Piece]) -> dict[str, torch.Tensor]:
    """One-device tensors from every rank's written pieces.

    A piece's ``start:end`` indexes the flattened tensor its rank holds: the whole
    tensor, or (``tp`` set) the block ``tp.local_shape(shape)`` that is block
    ``tp.index // tp.replicas`` along ``tp.dim`` of the tensor zero-padded to
    ``tp.shards * tp.block``. Asserts that every element of every held tensor (padding
    included) is written exactly once and that every tp block of a tensor is present.
    This index math is independent of ``plait.checkpoint.format``.
    """
    shapes: dict[str, list[int]] = {}
    blocks: dict[tuple[str, int], tuple[TPSplit | None, torch.Tensor, torch.Tensor]] = {}
    for name, shape, tp, start, end, value in pieces:
        assert shapes.setdefault(name, shape) == shape, f"{name}: shapes disagree"
        local = tp.local_shape(tuple(shape)) if tp is not None else tuple(shape)
        key = (name, tp.index // tp.replicas if tp is not None else -1)
        if key not in blocks:
            numel = torch.Size(local).numel()
            blocks[key] = (tp, torch.zeros(numel, dtype=value.dtype), torch.zeros(numel))
        _, flat, seen = blocks[key]
        assert value.shape == (end - start,), f"{name}: value {tuple(value.shape)} vs {start}:{end}"
        flat[start:end] = value
        seen[start:end] += 1
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, set[int]] = {}
    for (name, block), (tp, flat, seen) in blocks.items():
        assert bool((seen == 1).all()), f"{name}: elements written {seen.unique().tolist()} times"
        shape = shapes[name]
        if tp is None:
            assert name not in out, f"{name}: held both whole and as tp blocks"
            out[name] = flat.view(shape)
            continue
        if name not in out:
            padded = list(shape)
            padded[tp.dim] = tp.shards * tp.block  # (..., shards * block, ...)
            out[name] = torch.zeros(padded, dtype=flat.dtype)
            filled[name] = set()
        assert name in filled, f"{name}: held both whole and as tp blocks"
        out[name].narrow(tp.dim, block * tp.block, tp.block).copy_(
            flat.view(tp.local_shape(tuple(shape)))
        )
        filled[name].add(block)
    for name, done in filled.items():
        (tp, _, _) = next(v for k, v in blocks.items() if k[0] == name)
        assert tp is not None and done == set(range(tp.shards)), f"{name}: tp blocks {done}"
        tensor = out[name]
        for dim, full in enumerate(shapes[name]):  # drop the tp padding (vocabulary rows)
            tensor = tensor.narrow(dim, 0, full)
        out[name] = tensor
    return out


@pytest.fixture(scope="module")
def refs() -> dict[str, dict[str, Any]]:
    """The one-process reference run of each model, computed once for the module."""
    return {kind: _reference(kind) for kind in MODELS}


LAYOUTS = [
    # (model, world, dp, tp, pp, zero, micro-batches passed to pm.step)
    pytest.param("builtin", 2, 2, 1, 1, 0, 2, id="builtin-dp2-accum2"),
    pytest.param("builtin", 2, 2, 1, 1, 3, 2, id="builtin-zero3-dp2-accum2"),
    pytest.param("builtin", 2, 1, 2, 1, 0, 1, id="builtin-tp2"),
    pytest.param("builtin", 2, 1, 1, 2, 0, PIPELINE_MICROBATCHES, id="builtin-pp2-1f1b-m4"),
    pytest.param("builtin", 8, 2, 2, 2, 0, 1, id="builtin-dp2xtp2xpp2"),
    pytest.param("builtin", 8, 2, 2, 2, 1, 1, id="builtin-dp2xtp2xpp2-zero1"),
    pytest.param("encoder", 2, 2, 1, 1, 0, 2, id="encoder-dp2-accum2"),
    pytest.param("encoder", 2, 2, 1, 1, 1, 1, id="encoder-zero1-dp2"),
    pytest.param("encoder", 2, 2, 1, 1, 2, 2, id="encoder-zero2-dp2-accum2"),
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
    """The user's loop under the layout matches plain PyTorch on one process: loss and
    pre-clip gradient norm at every step on every rank (rtol 1e-9), and every weight
    after ``STEPS`` steps rebuilt from ``local_pieces()`` (rtol 1e-9, atol 1e-11)."""
    ref = refs[kind]
    assert min(ref["norms"]) > CLIP  # clipping is engaged at every step
    results = pools(world).run(_body, kind, dp, tp, pp, zero, micro)
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(ref["losses"], rel=RTOL), f"rank {rank} losses"
        assert r["norms"] == pytest.approx(ref["norms"], rel=RTOL), f"rank {rank} norms"
    got = assemble([p for r in results for p in r["pieces"]])
    assert sorted(got) == sorted(ref["weights"])  # every one-device name, exactly once
    for name, want in ref["weights"].items():
        assert got[name].dtype == torch.float64, name
        torch.testing.assert_close(got[name], want, rtol=RTOL, atol=ATOL, msg=name)


def _body_refused(ctx: WorkerContext, tp: int, pp: int) -> str:
    """``parallelize`` of the encoder model on a (tp, pp) mesh: the ConfigError's text,
    or "accepted"."""
    mesh = ctx.mesh(dp=1, tp=tp, pp=pp)
    try:
        parallelize(_encoder(), mesh)
    except ConfigError as e:
        return str(e)
    return "accepted"


def test_structure_a_model_lacks_is_refused_by_name(pools: Pools) -> None:
    """pp2 and tp2 on the ``nn.TransformerEncoder`` model raise ConfigError on every rank,
    naming what is missing: the pipeline split needs plait's Transformer attributes (and
    says what works instead); the default TP plan's patterns match no module."""
    pp_msgs = pools(2).run(_body_refused, 1, 2)
    for m in pp_msgs:
        assert "pipeline split: the model has no 'tok_embeddings'" in m, m
        assert "Use dp / ZeRO / tp for this model, or pp = 1" in m, m
    tp_msgs = pools(2).run(_body_refused, 2, 1)
    for m in tp_msgs:
        assert "tensor-parallel plan: 'tok_embeddings' matches no module" in m, m
