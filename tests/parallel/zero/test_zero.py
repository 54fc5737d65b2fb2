"""ZeRO stages 1-3: parity with one process, hybrid sharding, offload, traffic, memory.

Parity protocol: the model is built from one seed in fp32 and trained for STEPS AdamW
steps (two param groups: weight decay on matrices only) by plain PyTorch in the pytest
process over the whole global batch (``torch.nn.utils.clip_grad_norm_`` where clipping
is on). The same global batches are then run under ZeroDataParallel + Optimizer
with each rank taking its contiguous slice. Compared: the mean loss of every step, the
global gradient norm of every step, and every weight after the last step.

Tolerance (fp32): losses and norms rtol 2e-5; weights atol 2e-5 + rtol 2e-5. The only
difference from one process is the order of floating-point sums (the batch split into
rank slices and micro-batches, the reduction over ranks, the squared norm summed per
shard); after 5 AdamW steps with lr 1e-3 that moves weights by well under 1e-5 (the
observed maximum is printed by the failing assertion).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from plait import init_mesh
from plait.config import ParallelConfig, PrecisionConfig
from plait.mesh import Mesh
from plait.optim import Optimizer
from plait.parallel.data_parallel import DataParallel
from plait.parallel.parallelize import parallelize
from plait.parallel.recompute import apply_recompute
from plait.parallel.zero import ZeroDataParallel
from plait.parallel.zero.flat import ROOT
from plait.parallel.zero.reducer import GradientReducer
from plait.testing import WorkerContext, WorkerPool
from plait.train.memory import memory_report
from tests.parallel.test_data_parallel import VOCAB
from tests.tiny import read_metrics, run_plait, tiny_args, tiny_config

M = "tests.parallel.zero.test_zero"
STEPS = 5
GLOBAL_BATCH = 8
SEQ = 12
LR = 1e-3
CLIP = 0.05  # well below the gradient norms of these models: clipping is active
RTOL, ATOL = 2e-5, 2e-5


def _builtin(layers: int = 2) -> nn.Module:
    from plait.config import ModelConfig
    from plait.model import Transformer

    cfg = ModelConfig(
        vocab_size=VOCAB, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, max_seq_len=SEQ
    )
    return Transformer(cfg, seed=0)


class EncoderLM(nn.Module):
    """A model not written in plait: torch's TransformerEncoder with an embedding and head.

    ``bias=False`` in the encoder layers: the gradient of an attention *key* bias is
    exactly zero in theory (softmax is shift-invariant), so in fp32 it is pure rounding
    noise, which Adam normalises into updates of order lr·|g|/(|g| + eps) that differ
    with every change of summation order. Without it every gradient carries signal.
    """

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, bias=False)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)))  # (batch, seq, vocab)


MODELS: dict[str, Callable[[], nn.Module]] = {"builtin": _builtin, "encoder": EncoderLM}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4321)
    return [
        (
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(_groups(model), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(_groups(model), lr=LR, betas=(0.9, 0.95))


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))


def _reference(name: str, clip: float, opt_kind: str = "adamw") -> dict[str, Any]:
    """Plain PyTorch, one process, whole global batch."""
    model = _make(name)
    opt = _optimizer(model, opt_kind)
    losses, norms = [], []
    for x, y in _batches():
        loss = _loss(model(x), y)
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        norms.append(float(norm))
    weights = {k: p.detach().clone() for k, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights}


def _train(
    mesh: Mesh,
    name: str,
    stage: int,
    *,
    zero_shard_size: int | None = None,
    accum: int = 1,
    clip: float = 0.0,
    offload: str = "none",
    opt_kind: str = "adamw",
    recompute: str = "none",
    bucket_mb: float | None = None,
) -> dict[str, Any]:
    model = _make(name)
    if recompute != "none":
        apply_recompute(model, recompute)  # type: ignore[arg-type]
    zdp = ZeroDataParallel(
        model,
        mesh,
        stage,
        zero_shard_size=zero_shard_size,
        offload=offload,  # type: ignore[arg-type]
        bucket_mb=bucket_mb,
    )
    opt = Optimizer(zdp, _optimizer(model, opt_kind), max_norm=clip)
    n, r = mesh.size("dp"), mesh.index("dp")
    per_rank = GLOBAL_BATCH // n
    micro = per_rank // accum
    losses, norms = [], []
    for x, y in _batches():
        xs, ys = x[r * per_rank : (r + 1) * per_rank], y[r * per_rank : (r + 1) * per_rank]
        total = 0.0
        for k in range(accum):
            sl = slice(k * micro, (k + 1) * micro)
            ctx = zdp.no_sync() if k < accum - 1 else contextlib.nullcontext()
            with ctx:
                loss = _loss(zdp(xs[sl]), ys[sl])
                (loss / accum).backward()
            total += loss.item() / accum
        report = opt.step()
        opt.zero_grad()
        losses.append(total)
        norms.append(report.grad_norm)
    with zdp.gathered():
        weights = {k: p.detach().clone() for k, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights}


def _body_train(ctx: WorkerContext, name: str, stage: int, kw: dict[str, Any]) -> dict[str, Any]:
    return _train(ctx.mesh(dp=ctx.world_size), name, stage, **kw)


class _References(dict):  # type: ignore[type-arg]
    def __missing__(self, key: tuple[str, float, str]) -> dict[str, Any]:
        self[key] = _reference(*key)
        return self[key]


@pytest.fixture(scope="module")
def reference() -> dict[tuple[str, float, str], dict[str, Any]]:
    return _References()


def _check_parity(ref: dict[str, Any], results: list[dict[str, Any]]) -> None:
    world = len(results)
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in results) / world
        assert mean == pytest.approx(ref["losses"][step], rel=RTOL)
    for r in results:
        assert r["norms"] == pytest.approx(ref["norms"], rel=RTOL)
        for k, w in ref["weights"].items():
            torch.testing.assert_close(r["weights"][k], w, rtol=RTOL, atol=ATOL)
    for r in results[1:]:  # every rank ends with the same full weights
        for k, w in results[0]["weights"].items():
            assert torch.equal(r["weights"][k], w), k


PARITY = [
    # (world, model, stage, options)
    (2, "builtin", 0, {}),  # stage 0: replicated flat buffers, all-reduce
    *[(w, "builtin", s, {}) for w in (2, 4) for s in (1, 2, 3)],
    *[(w, "encoder", s, {}) for w in (2, 4) for s in (1, 2, 3)],
    *[(2, "builtin", s, {"accum": 2}) for s in (1, 2, 3)],
    *[(4, "builtin", s, {"clip": CLIP}) for s in (1, 2, 3)],
    *[(2, "encoder", s, {"clip": CLIP, "accum": 2}) for s in (0, 1, 2, 3)],
    *[(4, "builtin", s, {"zero_shard_size": 2}) for s in (1, 2, 3)],
    (4, "encoder", 3, {"zero_shard_size": 2, "clip": CLIP}),
    (4, "builtin", 1, {"zero_shard_size": 2, "clip": CLIP, "accum": 2}),
    (4, "encoder", 2, {"zero_shard_size": 2, "clip": CLIP, "accum": 2}),
    (2, "builtin", 2, {"zero_shard_size": 1}),  # F = 1: replicated shards, all-reduce = plain DP
    (2, "builtin", 2, {"opt_kind": "sgd"}),
    (4, "encoder", 3, {"opt_kind": "sgd", "clip": CLIP}),
    (2, "builtin", 3, {"recompute": "full"}),
    (2, "builtin", 3, {"recompute": "selective", "clip": CLIP}),
    # stages 1/2 with units fused into reduce-scatter / all-gather buckets
    *[(w, "builtin", s, {"bucket_mb": 0.05}) for w in (2, 4) for s in (1, 2)],
    (2, "builtin", 2, {"bucket_mb": 1.0, "clip": CLIP}),  # one bucket: every unit
    (2, "encoder", 1, {"bucket_mb": 0.05, "accum": 2, "clip": CLIP}),
    (4, "builtin", 2, {"bucket_mb": 0.05, "zero_shard_size": 2, "accum": 2}),
]


@pytest.mark.parametrize(
    ("world", "name", "stage", "kw"),
    PARITY,
    ids=[
        f"dp{w}-{n}-zero{s}-" + "-".join(f"{k}={v}" for k, v in kw.items())
        for w, n, s, kw in PARITY
    ],
)
def test_parity_with_one_process(
    pools: Callable[[int], WorkerPool],
    reference: dict[tuple[str, float, str], dict[str, Any]],
    world: int,
    name: str,
    stage: int,
    kw: dict[str, Any],
) -> None:
    ref = reference[(name, kw.get("clip", 0.0), kw.get("opt_kind", "adamw"))]
    results = pools(world).run(f"{M}:_body_train", name, stage, kw)
    _check_parity(ref, results)
    if kw.get("clip"):
        assert min(ref["norms"]) > kw["clip"]  # clipping really happened


def _body_tensor_parallel(ctx: WorkerContext, stage: int, sp: bool) -> dict[str, Any]:
    """dp2 x tp2: ZeRO over dp on a model whose parameters are tensor-parallel shards."""
    from plait.parallel.tensor.loss import vocab_parallel_loss
    from plait.parallel.tensor.sharding_plan import apply_tensor_parallel, gather_full_state

    mesh = ctx.mesh(dp=2, tp=2)
    model = apply_tensor_parallel(_make("builtin"), mesh, sp)
    zdp = ZeroDataParallel(model, mesh, stage)
    opt = Optimizer(zdp, _optimizer(model, "adamw"), max_norm=CLIP)
    loss_fn = vocab_parallel_loss(mesh, VOCAB)
    per, r = GLOBAL_BATCH // 2, mesh.index("dp")
    losses, norms = [], []
    mesh.stats.reset()
    for x, y in _batches():
        loss = loss_fn(zdp(x[r * per : (r + 1) * per]), y[r * per : (r + 1) * per])
        loss.backward()
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
        losses.append(loss.item())
    with zdp.gathered():
        weights = gather_full_state(model, mesh)
    s = mesh.stats
    dp_ops = {op for op in ("all_reduce", "reduce_scatter", "all_gather") if s.get("dp", op).calls}
    return {"losses": losses, "norms": norms, "weights": weights, "dp_ops": dp_ops}


@pytest.mark.parametrize(("stage", "sp"), [(1, False), (2, True), (3, False), (3, True)])
def test_composes_with_tensor_parallel_shards(
    pools: Callable[[int], WorkerPool],
    reference: dict[tuple[str, float, str], dict[str, Any]],
    stage: int,
    sp: bool,
) -> None:
    """dp2 x tp2 on 4 ranks: ZeroDataParallel flattens the TP shards and reduces over dp
    only; the clipping norm sums the shards over dp and tp, counting the norm gains
    (replicated over tp) once. Same losses, norms and gathered weights as one process
    (fp32; the tolerances of the parity test, tensor-parallel sums change the order)."""
    ref = reference[("builtin", CLIP, "adamw")]
    results = pools(4).run(f"{M}:_body_tensor_parallel", stage, sp)
    _check_parity(ref, results)
    for r in results:  # ZeRO's collectives on the dp axis (the norm: all-reduce)
        assert r["dp_ops"] >= {"reduce_scatter", "all_gather"}


@pytest.mark.parametrize(
    ("stage", "offload"), [(1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "params")]
)
def test_offload_matches_no_offload(
    pools: Callable[[int], WorkerPool],
    reference: dict[tuple[str, float, str], dict[str, Any]],
    stage: int,
    offload: str,
) -> None:
    """The CPU-offloaded step (separate fp32 masters and state on the host, torch's fused
    CPU AdamW, copies back) equals the step on the parameter shards up to the fused
    kernel's rounding (it evaluates AdamW's formula in another order: ~1e-8 relative per
    step): losses and norms rtol 1e-6, weights atol 1e-6 after 5 steps."""
    kw = {"clip": CLIP}
    plain = pools(2).run(f"{M}:_body_train", "builtin", stage, kw)
    off = pools(2).run(f"{M}:_body_train", "builtin", stage, {**kw, "offload": offload})
    for a, b in zip(plain, off, strict=True):
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-6)
        assert b["norms"] == pytest.approx(a["norms"], rel=1e-6)
        for k, w in a["weights"].items():
            torch.testing.assert_close(b["weights"][k], w, rtol=0, atol=1e-6)
    _check_parity(reference[("builtin", CLIP, "adamw")], off)


def _body_offload_devices(ctx: WorkerContext, stage: int, offload: str) -> dict[str, Any]:
    mesh = ctx.mesh(dp=ctx.world_size)
    model = _make("builtin")
    zdp = ZeroDataParallel(model, mesh, stage, offload=offload)  # type: ignore[arg-type]
    opt = Optimizer(zdp, _optimizer(model, "adamw"))
    x, y = _batches()[0]
    _loss(zdp(x[:4]), y[:4]).backward()
    opt.step()
    masters = opt.master_tensors()
    shards = [zdp.param_shard(u) for u in zdp.units]
    return {
        "master_devices": {str(t.device) for t in masters},
        "n_masters": len(masters),
        "aliased": any(
            m.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
            for m, s in zip(masters, shards, strict=True)
        ),
        "state_devices": {
            str(v.device) for st in opt.state.values() for v in st.values() if v.dim() > 0
        },
        "shard_devices": {str(s.device) for s in shards},
    }


def test_offload_keeps_masters_and_state_on_the_cpu(pools: Callable[[int], WorkerPool]) -> None:
    for r in pools(2).run(f"{M}:_body_offload_devices", 2, "optimizer"):
        assert r["master_devices"] == {"cpu"} and r["state_devices"] == {"cpu"}
        assert r["n_masters"] > 0 and not r["aliased"]  # separate copies, even on a CPU
    for r in pools(2).run(f"{M}:_body_offload_devices", 3, "params"):
        assert r["shard_devices"] == {"cpu"} and r["master_devices"] == {"cpu"}


# ----------------------------------------------------------------------------- traffic


def _body_traffic(ctx: WorkerContext, stage: int, bucket_mb: float | None = None) -> dict[str, Any]:
    mesh = ctx.mesh(dp=ctx.world_size)
    model = _make("builtin")
    wrapped: nn.Module
    buckets = 0
    if stage == 0:
        wrapped = DataParallel(model, mesh, bucket_mb=0.01)
        opt = Optimizer(wrapped, _optimizer(model, "adamw"))
    else:
        wrapped = ZeroDataParallel(model, mesh, stage, bucket_mb=bucket_mb)
        opt = Optimizer(wrapped, _optimizer(model, "adamw"))
        buckets = len(wrapped.reducer.buckets)
    x, y = _batches()[0]
    per = GLOBAL_BATCH // ctx.world_size
    mesh.stats.reset()
    _loss(wrapped(x[:per]), y[:per]).backward()
    opt.step()
    units = []
    if isinstance(wrapped, ZeroDataParallel):
        units = [(u.name, list(u.names)) for u in wrapped.units]
    s = mesh.stats
    return {
        "units": units,
        "buckets": buckets,
        "numel": sum(p.numel() for p in model.parameters()),
        **{
            op: (s.get("dp", op).bytes, s.get("dp", op).calls)
            for op in ("all_reduce", "reduce_scatter", "all_gather")
        },
    }


@pytest.mark.parametrize("world", [2, 4])
def test_traffic_matches_formulas(pools: Callable[[int], WorkerPool], world: int) -> None:
    """Bus bytes per step (one step, no accumulation) from the counters, exactly:
    DP all-reduce 2(N-1)/N·S; stage 1/2 reduce-scatter + all-gather of the padded units
    = 2(N-1)/N·S' (S' = S + padding); stage 3 all-gathers every unit twice (forward and
    backward; here the root unit, the final norm, is used by one module and resharded
    like the others) plus one reduce-scatter: 1.5·S'/S x DP. The only all-reduce under
    ZeRO is the global gradient norm (one fp64)."""
    n = world
    f = (n - 1) / n
    dp = pools(world).run(f"{M}:_body_traffic", 0)[0]
    s_bytes = 4 * dp["numel"]
    numel = {k: p.numel() for k, p in _make("builtin").named_parameters()}
    assert dp["all_reduce"][0] == pytest.approx(2 * f * s_bytes, rel=1e-12)
    for stage in (1, 2, 3):
        for r in pools(world).run(f"{M}:_body_traffic", stage):
            sizes = {name: sum(numel[k] for k in names) for name, names in r["units"]}
            padded = {name: math.ceil(size / n) * n for name, size in sizes.items()}
            assert sum(sizes.values()) == dp["numel"]
            padded_bytes = 4 * sum(padded.values())
            assert padded_bytes - s_bytes < 4 * n * len(padded)  # padding < N per unit
            rs, ag = r["reduce_scatter"][0], r["all_gather"][0]
            assert rs == pytest.approx(f * padded_bytes, rel=1e-12)
            assert r["all_reduce"] == (pytest.approx(2 * f * 8, rel=1e-12), 1)  # the norm
            if stage < 3:
                assert ag == pytest.approx(f * padded_bytes, rel=1e-12)
                assert (rs + ag) / dp["all_reduce"][0] == pytest.approx(1.0, rel=0.01)
                assert r["reduce_scatter"][1] == r["all_gather"][1] == len(padded)
            else:
                assert ag == pytest.approx(2 * f * padded_bytes, rel=1e-12)
                ratio = (rs + ag) / dp["all_reduce"][0]
                assert ratio == pytest.approx(1.5 * padded_bytes / s_bytes, rel=1e-12)
                assert 1.5 <= ratio < 1.51
    for stage in (1, 2):  # fused into buckets: the same bytes in fewer, larger calls
        for r, ref in zip(
            pools(world).run(f"{M}:_body_traffic", stage, 0.05),
            pools(world).run(f"{M}:_body_traffic", stage),
            strict=True,
        ):
            assert 1 < r["buckets"] < len(r["units"])
            for op in ("reduce_scatter", "all_gather"):
                assert r[op][0] == pytest.approx(ref[op][0], rel=1e-12)
                assert r[op][1] == r["buckets"]


def _body_hybrid_traffic(ctx: WorkerContext, stage: int) -> dict[str, Any]:
    mesh = ctx.mesh(dp=ctx.world_size)
    model = _make("builtin")
    zdp = ZeroDataParallel(model, mesh, stage, zero_shard_size=2)
    opt = Optimizer(zdp, _optimizer(model, "adamw"))
    x, y = _batches()[0]
    mesh.stats.reset()
    _loss(zdp(x[:2]), y[:2]).backward()
    opt.step()
    s = mesh.stats
    return {
        "padded": sum(u.padded for u in zdp.units),
        "ops": {
            (axis, op): (s.get(axis, op).bytes, s.get(axis, op).calls)
            for axis in ("dp", "dp_shard", "dp_replicate")
            for op in ("all_reduce", "reduce_scatter", "all_gather")
            if s.get(axis, op).calls
        },
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_traffic_matches_formulas(pools: Callable[[int], WorkerPool], stage: int) -> None:
    """dp 4, F = 2: reduce-scatter and all-gather inside the shard groups of 2
    ((F-1)/F·S' bus bytes each; stage 3 gathers twice), the gradient shards (S'/F)
    all-reduced across the 2 replicas (2·(R-1)/R·S'/F), the norm (one fp64) all-reduced
    in the shard group only. Nothing else, exactly."""
    for r in pools(4).run(f"{M}:_body_hybrid_traffic", stage):
        sp = 4 * r["padded"]  # S': fp32 bytes of the padded units
        ops = r["ops"]
        rs_bytes, rs_calls = ops[("dp_shard", "reduce_scatter")]
        ag_bytes, ag_calls = ops[("dp_shard", "all_gather")]
        ar_bytes, ar_calls = ops[("dp_replicate", "all_reduce")]
        norm_bytes, norm_calls = ops[("dp_shard", "all_reduce")]
        n_units = rs_calls  # one reduce-scatter per unit
        assert rs_bytes == pytest.approx(0.5 * sp, rel=1e-12)
        gathers = 2 if stage == 3 else 1
        assert (ag_bytes, ag_calls) == (
            pytest.approx(gathers * 0.5 * sp, rel=1e-12),
            gathers * n_units,
        )
        assert (ar_bytes, ar_calls) == (pytest.approx(2 * 0.5 * sp / 2, rel=1e-12), n_units)
        assert (norm_bytes, norm_calls) == (pytest.approx(2 * 0.5 * 8, rel=1e-12), 1)
        assert set(ops) == {
            ("dp_shard", "reduce_scatter"),
            ("dp_shard", "all_gather"),
            ("dp_shard", "all_reduce"),
            ("dp_replicate", "all_reduce"),
        }


# ----------------------------------------------------------------------------- stage 3


def _body_live(ctx: WorkerContext, reshard: bool, prefetch: bool) -> dict[str, Any]:
    mesh = ctx.mesh(dp=ctx.world_size)
    model = _builtin(layers=4)
    zdp = ZeroDataParallel(
        model, mesh, 3, reshard_after_forward=reshard, prefetch=prefetch, record_events=True
    )
    opt = Optimizer(zdp, _optimizer(model, "adamw"))
    x, y = _batches()[0]
    real = {"peak": 0}

    def probe(*_: Any) -> None:
        """Live gathered bytes read from the tensors themselves (not the wrapper's
        counter): every unit's full-size storage plus the outputs of gathers in flight
        that are not a unit's own buffer (a gather lands there when the dtypes agree)."""
        live = sum(u.full.untyped_storage().nbytes() for u in zdp.units)
        assert zdp.gatherer is not None
        own = [u.full for u in zdp.units]
        live += sum(
            out.untyped_storage().nbytes()
            for out in zdp.gatherer.in_flight()
            if all(out is not f for f in own)
        )
        real["peak"] = max(real["peak"], live)

    for m in model.modules():  # after every gather and free: forward and backward
        m.register_forward_pre_hook(probe)
        m.register_forward_hook(probe)
        m.register_full_backward_pre_hook(probe)
        m.register_full_backward_hook(probe)
    for _ in range(2):  # the second step prefetches in the recorded forward order
        zdp.reset_peak_gathered()
        real["peak"] = 0
        _loss(zdp(x[:4]), y[:4]).backward()
        opt.step()
        opt.zero_grad()
    assert zdp.gatherer is not None
    order = [u.name for u in zdp.driver.order]
    size = {u.name: u.padded * 4 for u in zdp.units}
    return {
        "order": order,
        "size": size,
        "peak_bytes": zdp.peak_gathered_bytes,
        "peak_units": zdp.peak_gathered_units,
        "real_peak": real["peak"],
        "after": zdp.gathered_bytes,
        "events": zdp.events,
        "params_empty": all(p.numel() == 0 for p in model.parameters()),
    }


def test_stage3_holds_at_most_current_and_prefetched_unit(
    pools: Callable[[int], WorkerPool],
) -> None:
    for r in pools(2).run(f"{M}:_body_live", True, True):
        order, size = r["order"], r["size"]
        assert order[0] == "tok_embeddings" and order[-1] == "output"
        pairs = max(size[a] + size[b] for a, b in itertools.pairwise(order))
        assert r["peak_units"] <= 2
        assert max(size.values()) < r["peak_bytes"] <= pairs  # prefetch overlapped
        # the same bound measured on the storages: gathered unit + buffer of the prefetch
        assert max(size.values()) < r["real_peak"] <= pairs
        assert r["after"] == 0 and r["params_empty"]  # everything freed after the step
        ev = [e for e in r["events"] if e[0] in ("gather", "free")]
        # forward: the next block is gathered before the current one is freed
        assert ev.index(("gather", "layers.1")) < ev.index(("free", "layers.0"))
        kinds = [k for k, _ in r["events"]]
        assert kinds.count("reduce") == len(size) and kinds[-1] == "synced"
        # every unit is gathered twice (forward, backward)
        gathers = [n for k, n in r["events"] if k == "gather"]
        assert sorted(gathers) == sorted(list(size) * 2)


def test_stage3_backward_gathers_in_reverse_order_with_bounded_peak(
    pools: Callable[[int], WorkerPool],
) -> None:
    """Backward of the second step (prefetch follows the recorded forward order): units
    are gathered in exactly the reverse forward order, each prefetch is issued while the
    unit after it is still held (overlap), and the gathered bytes during backward, replayed
    from the gather/free events, peak above one unit and at most one adjacent pair."""
    for r in pools(2).run(f"{M}:_body_live", True, True):
        order, size = r["order"], r["size"]
        second = r["events"]  # the events of the last step only
        at = [i for i, (k, _) in enumerate(second) if k == "gather"]
        start = at[len(order)]  # forward gathers each unit once; then backward begins
        fwd, bwd = second[:start], second[start:]
        assert [n for k, n in fwd if k == "gather"] == order
        assert [n for k, n in bwd if k == "gather"] == order[::-1]
        for later, earlier in itertools.pairwise(order[::-1]):  # prefetch before free
            assert bwd.index(("gather", earlier)) < bwd.index(("free", later)), earlier
        held = peak_fwd = peak_bwd = 0  # replay: everything is free when a step starts
        for i, (k, n) in enumerate(second):
            if k in ("gather", "free"):
                held += size[n] if k == "gather" else -size[n]
                if i < start:
                    peak_fwd = max(peak_fwd, held)
                else:
                    peak_bwd = max(peak_bwd, held)
        assert held == 0
        pairs = max(size[a] + size[b] for a, b in itertools.pairwise(order))
        assert max(size.values()) < peak_bwd <= pairs
        assert max(peak_fwd, peak_bwd) == r["peak_bytes"]  # the gatherer's own counter


def test_stage3_without_prefetch_or_reshard(pools: Callable[[int], WorkerPool]) -> None:
    for r in pools(2).run(f"{M}:_body_live", True, False):
        assert r["peak_units"] == 1  # one unit at a time
        assert r["peak_bytes"] == r["real_peak"] == max(r["size"].values())
    for r in pools(2).run(f"{M}:_body_live", False, True):
        gathers = [n for k, n in r["events"] if k == "gather"]
        assert sorted(gathers) == sorted(r["size"])  # kept from forward to backward
        assert r["peak_bytes"] == r["real_peak"] == sum(r["size"].values())


def _body_overlap(ctx: WorkerContext, stage: int) -> dict[str, Any]:
    mesh = ctx.mesh(dp=ctx.world_size)
    model = _builtin(layers=4)
    zdp = ZeroDataParallel(model, mesh, stage, record_events=True)
    x, y = _batches()[0]
    _loss(zdp(x[:4]), y[:4]).backward()
    return {
        "events": zdp.events,
        "peak_grad_bytes": zdp.peak_grad_buffer_bytes,
        "grad_bytes_after": zdp.grad_buffer_bytes,
        "size": {u.name: u.padded * 4 for u in zdp.units},
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_are_reduce_scattered_during_backward(
    pools: Callable[[int], WorkerPool], stage: int
) -> None:
    """Each unit's reduce-scatter starts as soon as backward has produced its gradients
    (before earlier layers have any), and at most MAX_REDUCES_IN_FLIGHT + 1 full-size
    gradient buffers exist at once: never the whole model's gradients."""
    for r in pools(2).run(f"{M}:_body_overlap", stage):
        ev = r["events"]
        assert ev.index(("reduce", "output")) < ev.index(("grad", "layers.2"))
        assert ev.index(("reduce", "layers.3")) < ev.index(("grad", "layers.0"))
        assert ev[-1] == ("synced", "")
        sizes = sorted(r["size"].values(), reverse=True)
        window = GradientReducer.MAX_REDUCES_IN_FLIGHT + 1
        assert r["peak_grad_bytes"] <= sum(sizes[:window]) < sum(sizes)
        assert r["grad_bytes_after"] == 0


def _body_overlap_1_2(ctx: WorkerContext, stage: int) -> dict[str, Any]:
    """Two optimizer steps of ZeRO-1/2 (the first accumulating over a ``no_sync``
    micro-step); the events of the last backward, then of the next forward with each
    unit's forward marked ("computed", unit name)."""
    mesh = ctx.mesh(dp=ctx.world_size)
    model = _builtin(layers=4)
    zdp = ZeroDataParallel(model, mesh, stage, record_events=True)
    opt = Optimizer(zdp, _optimizer(model, "adamw"))
    for u in zdp.units:
        if u.module is not None:
            u.module.register_forward_hook(
                lambda m, a, o, name=u.name: zdp.events.append(("computed", name))
            )
    x, y = _batches()[0]
    with zdp.no_sync():
        _loss(zdp(x[:2]), y[:2]).backward()
    no_sync_events = list(zdp.events)
    _loss(zdp(x[2:4]), y[2:4]).backward()
    backward_events = list(zdp.events)
    opt.step()
    pending = zdp.gathers_in_flight
    out = zdp(x[:2])  # completes the gathers unit by unit
    forward_events = list(zdp.events)
    with zdp.gathered():
        weights = [p.detach().clone() for p in model.parameters()]
    return {
        "no_sync": no_sync_events,
        "backward": backward_events,
        "forward": forward_events,
        "pending": pending,
        "units": [u.name for u in zdp.units],
        "weights": weights,
        "finite": bool(torch.isfinite(out).all()),
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_2_reduce_scatter_starts_before_backward_ends(
    pools: Callable[[int], WorkerPool], stage: int
) -> None:
    """ZeRO-1 and ZeRO-2 launch a unit's reduce-scatter from the backward hook as soon as
    its gradients are complete: the output head's (the first unit backward finishes) is
    launched before the first block has any gradient, i.e. before backward ends. Stage
    1 then waits for none of them inside backward (every "scattered" event, the wait,
    follows the last gradient) and inside ``no_sync`` reduces nothing. After the step
    every unit's all-gather is still in flight and each completes just before its own
    unit's forward: the last block's after the first block has computed."""
    results = pools(2).run(f"{M}:_body_overlap_1_2", stage)
    for r in results:
        reduced = [e for e in r["no_sync"] if e[0] in ("reduce", "scattered")]
        assert bool(reduced) == (stage == 2)  # stage 2 reduces every micro-step
        ev = r["backward"]
        kinds = [k for k, _ in ev]
        last_grad = len(kinds) - 1 - kinds[::-1].index("grad")
        first_reduce = kinds.index("reduce")
        assert first_reduce < last_grad, ev
        assert ev.index(("reduce", "output")) < ev.index(("grad", "layers.0")), ev
        assert kinds.count("reduce") == len(r["units"]) and ev[-1] == ("synced", "")
        if stage == 1:
            assert all(i > last_grad for i, k in enumerate(kinds) if k == "scattered"), ev
        assert r["pending"] == len(r["units"])
        fwd = r["forward"]
        assert sorted(n for k, n in fwd if k == "gathered") == sorted(r["units"])
        assert fwd.index(("computed", "layers.0")) < fwd.index(("gathered", "layers.3")), fwd
        assert fwd.index(("gathered", "layers.3")) < fwd.index(("computed", "layers.3")), fwd
        assert r["finite"]
    for a, b in zip(results[0]["weights"], results[1]["weights"], strict=True):
        assert torch.equal(a, b)  # every rank holds the same full parameters again


# ----------------------------------------------------------------------------- memory


def _body_memory(ctx: WorkerContext, stage: int) -> dict[str, Any]:
    mesh = ctx.mesh(dp=ctx.world_size)
    model = _make("builtin")
    pm = parallelize(
        model, mesh, ParallelConfig(zero=stage), precision=PrecisionConfig(dtype="bf16")
    )
    wrapped = pm.zero
    assert isinstance(wrapped, ZeroDataParallel)
    opt = Optimizer(pm, _optimizer(model, "adamw"))
    x, y = _batches()[0]
    per = GLOBAL_BATCH // ctx.world_size
    _loss(wrapped(x[:per]), y[:per]).backward()
    opt.step()
    rep = memory_report(wrapped, opt, ctx.rank)
    return {
        "bytes": rep.bytes,
        "numel": rep.numel,
        "units": [list(u.names) for u in wrapped.units],
        "index": wrapped.shard_group.index,
        "dtypes": {str(p.dtype) for p in model.parameters()},
    }


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_bytes_match_the_formulas(
    pools: Callable[[int], WorkerPool], stage: int, n: int
) -> None:
    """bf16 parameters, bf16 gradients, fp32 masters, AdamW: per-rank bytes equal
    2·P + 2·G + 4·M + 8·V exactly, where the test computes the padded sizes: P and G are
    the full padded units (stage 0/1; stage 0 has no padding) or this rank's shards, M the
    shard (padding included: the master is one flat tensor), V the shard's real
    elements (optimizer state is per parameter piece). The totals are then within the
    padding of 16, 2+2+12/N, 2+14/N and 16/N bytes per parameter."""
    numel = {k: p.numel() for k, p in _make("builtin").named_parameters()}
    for r in pools(n).run(f"{M}:_body_memory", stage):
        assert r["dtypes"] == {"torch.bfloat16"}
        shards = 1 if stage == 0 else n
        full = shard = valid = 0
        for names in r["units"]:
            total = sum(numel[k] for k in names)
            padded = math.ceil(total / shards) * shards
            s = padded // shards
            lo = r["index"] * s if shards > 1 else 0
            full += padded
            shard += s
            valid += max(0, min(lo + s, total) - lo)
        params = full if stage < 3 else shard
        grads = full if stage < 2 else shard
        b = r["bytes"]
        assert b["params"] == 2 * params
        assert b["grads"] == 2 * grads
        assert b["master"] == 4 * shard
        assert b["optimizer"] == 8 * valid
        assert b["gathered"] == 0
        per_param = (b["params"] + b["grads"] + b["master"] + b["optimizer"]) / r["numel"]
        formula = {0: 16.0, 1: 2 + 2 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage]
        assert per_param == pytest.approx(formula, abs=0.05)


# ----------------------------------------------------------------------------- checks


def test_wrap_units_default_and_policies() -> None:
    mesh = init_mesh()
    model = _builtin(layers=3)
    names = [u.name for u in ZeroDataParallel(_builtin(3), mesh, 3).units]
    assert names == ["tok_embeddings", "layers.0", "layers.1", "layers.2", "output", ROOT]
    enc = [u.name for u in ZeroDataParallel(_make("encoder"), mesh, 2).units]
    assert enc == ["emb", "enc.layers.0", "enc.layers.1", "head"]
    by_class = ZeroDataParallel(model, mesh, 1, wrap=[nn.Linear])
    assert all(
        u.name == ROOT or u.name.endswith(("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output"))
        for u in by_class.units
    )
    by_fn = ZeroDataParallel(_builtin(2), mesh, 1, wrap=lambda n, m: n == "layers")
    assert [u.name for u in by_fn.units] == ["layers", ROOT]
    # every parameter is a view into its unit's flat buffer (stages 1/2)
    for u in by_fn.units:
        for i, p in enumerate(u.params):
            assert p.data_ptr() == u.view(i, u.full).data_ptr()


@pytest.mark.parametrize(
    ("stage", "offload"), [(0, "none"), (1, "none"), (3, "none"), (3, "params")]
)
def test_fp64_parameters_are_kept_exactly(stage: int, offload: str) -> None:
    """A float64 model keeps its exact values (no round trip through fp32) and trains in
    float64: its masters are the parameter shards themselves (offloaded: fp64 copies)."""
    model = _builtin().double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-12)  # not representable in fp32 next to values of order 1e-2
    want = {k: p.detach().clone() for k, p in model.named_parameters()}
    zdp = ZeroDataParallel(model, init_mesh(), stage, offload=offload)  # type: ignore[arg-type]
    opt = Optimizer(zdp, torch.optim.SGD(model.parameters(), lr=0.0))
    with zdp.gathered():
        for k, p in model.named_parameters():
            assert p.dtype == torch.float64 and torch.equal(p, want[k]), k
    x = torch.randint(0, VOCAB, (2, SEQ))
    _loss(zdp(x), x).backward()
    opt.step()  # lr 0: the weights stay exactly
    masters = opt.master_tensors()
    assert (masters == []) == (offload == "none")
    assert all(m.dtype == torch.float64 for m in masters)
    with zdp.gathered():
        for k, p in model.named_parameters():
            assert torch.equal(p, want[k]), k


def test_tied_embeddings_go_to_the_root_unit() -> None:
    from plait.config import ModelConfig
    from plait.model import Transformer

    cfg = ModelConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, max_seq_len=SEQ, tie_embeddings=True
    )
    model = Transformer(cfg, seed=0)
    ref = Transformer(cfg, seed=0)
    zdp = ZeroDataParallel(model, init_mesh(), 3)
    root = next(u for u in zdp.units if u.name == ROOT)
    assert any(p is model.tok_embeddings.weight for p in root.params)
    assert {u.name for u in zdp.units} == {"layers.0", "layers.1", ROOT}
    assert model.tok_embeddings in root.triggers and model.output in root.triggers
    x = torch.randint(0, VOCAB, (2, SEQ))
    torch.testing.assert_close(zdp(x), ref(x), rtol=0, atol=0)


def test_bad_arguments() -> None:
    mesh = init_mesh()
    from plait.errors import ConfigError

    with pytest.raises(ConfigError, match="stage must be 0, 1, 2 or 3"):
        ZeroDataParallel(_builtin(), mesh, 4)
    with pytest.raises(ConfigError, match=r"needs ZeRO \(parallel\.zero >= 1\)"):
        ZeroDataParallel(_builtin(), mesh, 0, offload="optimizer")
    with pytest.raises(ConfigError, match=r"needs parallel\.zero = 3 \(got 2\)"):
        ZeroDataParallel(_builtin(), mesh, 2, offload="params")
    with pytest.raises(ConfigError, match=r"\(F = 2\) must divide the data-parallel degree dp = 1"):
        ZeroDataParallel(_builtin(), mesh, 2, zero_shard_size=2)
    with pytest.raises(TypeError, match="fp32 master weights"):
        Optimizer(_builtin().to(torch.bfloat16), torch.optim.SGD(_builtin().parameters()))
    model = _builtin()
    with pytest.raises(TypeError, match="element-wise"):
        Optimizer(ZeroDataParallel(model, mesh, 1), torch.optim.LBFGS(model.parameters()))


# ----------------------------------------------------------------------------- trainer / CLI


def _run_trainer(mesh: Mesh, parallel: dict[str, Any], micro: int | None) -> dict[str, Any]:
    from plait.train.trainer import Trainer

    trainer = Trainer(tiny_config(micro, parallel=parallel), mesh, show_progress=False)
    summary = trainer.run()
    return {
        "losses": summary.losses,
        "vals": [v for _, v in summary.val_losses],
        "memory": trainer.memory_report().bytes,
        "wrapper": type(trainer.model.module).__name__,
    }


def _body_trainer(ctx: WorkerContext, parallel: dict[str, Any], micro: int | None) -> Any:
    return _run_trainer(ctx.mesh(dp=ctx.world_size), parallel, micro)


@pytest.fixture(scope="module")
def trainer_one_process() -> dict[str, Any]:
    return _run_trainer(init_mesh(), {}, None)


TRAINER = [
    (2, {"zero": 3}, None),
    (2, {"zero": 1, "offload": "optimizer"}, 2),
    (4, {"zero": 2, "zero_shard_size": 2}, None),
    (4, {"zero": 3, "offload": "params", "reshard_after_forward": False}, 1),
]


@pytest.mark.parametrize(("world", "parallel", "micro"), TRAINER)
def test_trainer_zero_layouts_match_one_process(
    pools: Callable[[int], WorkerPool],
    trainer_one_process: dict[str, Any],
    world: int,
    parallel: dict[str, Any],
    micro: int | None,
) -> None:
    """The whole trainer (sampling, accumulation, clipping at 1.0, AdamW with two param
    groups, warm-up/cosine schedule) under ZeRO: the same losses as one process (rtol
    1e-5, as tests/train/test_trainer.py)."""
    ref = trainer_one_process
    assert ref["wrapper"] == "DataParallel"
    for r in pools(world).run(f"{M}:_body_trainer", parallel, micro):
        assert r["wrapper"] == "ZeroDataParallel"
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert r["vals"] == pytest.approx(ref["vals"], rel=1e-5)
        assert r["memory"]["optimizer"] < ref["memory"]["optimizer"]  # sharded state


def test_cli_refuses_bad_zero_input(capsys: pytest.CaptureFixture[str]) -> None:
    from plait.cli import main

    cases = [
        (["--zero", "4"], "parallel.zero must be 0, 1, 2 or 3, got 4"),
        (["--nproc", "4", "--zero", "2", "--parallel.zero_shard_size", "3"], "must divide"),
        (["--nproc", "2", "--parallel.offload", "optimizer"], "needs ZeRO"),
        (
            ["--nproc", "2", "--zero", "1", "--parallel.offload", "params"],
            "needs parallel.zero = 3",
        ),
    ]
    for args, text in cases:
        code = main(["train", *args])
        err = capsys.readouterr().err
        assert code == 2, err
        assert text in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_train_zero3_two_processes(tmp_path: Any) -> None:
    """`plait train --nproc 2 --zero 3` end to end: banner, memory report, metrics."""
    out = tmp_path / "m.jsonl"
    args = [
        *tiny_args(),
        "--nproc",
        "2",
        "--steps",
        "3",
        "--zero",
        "3",
        "--parallel.offload",
        "optimizer",
        "--train.recompute",
        "full",
        "--metrics",
        str(out),
    ]
    r = run_plait(["train", *args], tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ZeRO stage 3 over dp: shard groups of 2" in r.stdout
    assert "offload optimizer" in r.stdout and "recompute full" in r.stdout
    assert r.stdout.count("memory of rank 0") == 1  # once, after the first step
    rows = read_metrics(out)
    assert [row["step"] for row in rows] == [1, 2, 3]
    mem = rows[0]["memory"]
    assert mem["master"] > 0 and mem["optimizer"] > 0 and mem["total_cpu"] == mem["total"]
    assert all(row["memory"] is None for row in rows[1:])
    # peak memory per step: reported where the device has a counter (CUDA), None on CPU
    assert all("peak_memory_bytes" in row and row["peak_memory_bytes"] is None for row in rows)
