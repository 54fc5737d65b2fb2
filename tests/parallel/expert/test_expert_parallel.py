"""Expert parallelism against one process (float64), and its all-to-all traffic.

The user's loop of ``tests/parallel/test_parallelize.py`` on an MoE transformer (4
layers, MoE on every second one, 4 experts top-2, one shared expert): each data rank
feeds its slice of the global batch; ``parallel.ep`` splits the experts over a sub-axis
of the data ranks. Compared with plain PyTorch on one process over the whole batch
(same seed and batches; the aux and z losses enter through the MoE layers themselves):
the loss and the pre-clip gradient norm at every step on every rank, the router's
load-balancing loss of every MoE layer at every step (each rank's, averaged over the
data ranks, is the global batch's), and every weight after the steps, rebuilt from
``local_pieces()`` (each element written exactly once; the expert weights as blocks
along the expert dimension). Tolerances as there (rtol 1e-9, atol 1e-11): the layouts
differ only in summation order.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plait import comm
from plait.config import ModelConfig, ParallelConfig
from plait.model import Transformer
from plait.model.moe import MoE
from plait.optim import Optimizer
from plait.parallel.expert import ExpertParallelDispatch, ep_bytes_per_layer
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext
from tests.parallel.test_parallelize import ATOL, CLIP, LR, RTOL, Piece, Pools, assemble

STEPS, BATCH, SEQ, VOCAB = 5, 8, 16, 64
MOE = ModelConfig(
    vocab_size=VOCAB,
    dim=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    max_seq_len=SEQ,
    moe_experts=4,
    moe_top_k=2,
    moe_every=2,
    moe_shared_experts=1,
    moe_hidden_dim=24,
    moe_aux_loss_coef=0.1,
    moe_z_loss_coef=0.01,
)
MOE_HF = replace(
    MOE,
    moe_norm_topk_prob=False,
    moe_shared_expert_gate=True,
    moe_aux_loss_scope="model",
    moe_z_loss_coef=0.0,
)
"""Qwen2-MoE's router as transformers defines it: top-k weights not renormalised, the
shared expert gated by sigmoid(x . w), one load-balancing loss over every MoE layer, no
z-loss."""
MODELS = {"plait": MOE, "hf": MOE_HF}


def _model(cfg: ModelConfig = MOE) -> Transformer:
    return Transformer(cfg, seed=3).double()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _moes(model: torch.nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def _reference(dp: int, m: int, cfg: ModelConfig = MOE) -> dict[str, Any]:
    """Plain PyTorch on one process over the global batch, in the ``m`` micro-batches a
    pipeline over ``dp`` ranks computes (micro-batch k: every dp rank's k-th slice; the
    router losses are per micro-batch, so the reference takes the same ones)."""
    model = _model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for moe in _moes(model):
        moe.grad_scale = 1.0 / m  # the aux losses' share, as the loss's
    losses, norms, aux = [], [], []
    per = BATCH // dp
    for x, y in _batches():
        total = 0.0
        for k in range(m):
            rows = [r * per + k * per // m + i for r in range(dp) for i in range(per // m)]
            loss = F.cross_entropy(model(x[rows]).reshape(-1, VOCAB), y[rows].reshape(-1))
            (loss / m).backward()
            total += loss.item() / m
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
        aux.append([float(m_.stats.aux_loss) for m_ in _moes(model) if m_.stats is not None])
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = [m_.stats for m_ in _moes(model) if m_.stats is not None]  # last micro-batch
    summary = {
        "moe_aux_loss": sum(float(s.aux_loss) for s in stats) / len(stats),
        "moe_z_loss": sum(float(s.z_loss) for s in stats) / len(stats),
        "moe_load_min": min(float(s.load.min()) for s in stats),
        "moe_load_max": max(float(s.load.max()) for s in stats),
        "moe_dropped": float(sum(s.dropped for s in stats)),
    }
    return {
        "losses": losses, "norms": norms, "aux": aux, "weights": weights, "summary": summary,
    }  # fmt: skip


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    """The whole global batch at once."""
    return _reference(1, 1)


def _body(
    ctx: WorkerContext, ep: int, tp: int = 1, zero: int = 0, pp: int = 1, cp: int = 1,
    rc: str = "none", micro: int = 1, offload: str = "none", shard: int | None = None,
    model: str = "plait",
) -> dict[str, Any]:  # fmt: skip
    dp = ctx.world_size // (tp * pp * cp)
    mesh = ctx.mesh(dp=dp, tp=tp, pp=pp, cp=cp)
    cfg = ParallelConfig(
        ep=ep, bucket_mb=0.01, zero=zero, microbatches=2, offload=offload,  # type: ignore[arg-type]
        zero_shard_size=shard,
    )  # fmt: skip
    pm = parallelize(_model(MODELS[model]), mesh, cfg, recompute=rc)  # type: ignore[arg-type]
    opt = Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=LR), max_norm=CLIP)
    per, r = BATCH // dp, mesh.index("dp")
    losses, norms, aux, ep_bytes, formula = [], [], [], [], []
    dispatchers = [m.dispatcher for m in pm.experts.moes]  # this stage's
    for x, y in _batches():
        before = mesh.stats.get("ep", "all_to_all").bytes
        for d in dispatchers:
            assert isinstance(d, ExpertParallelDispatch)
            d.history = []  # collect this step's splits
        xr, yr = x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]
        losses.append(float(pm.step(xr, yr, micro_batches=micro)))
        ep_bytes.append(mesh.stats.get("ep", "all_to_all").bytes - before)
        step_formula = 0.0
        for d in dispatchers:  # every MoE layer of this stage, every micro-batch
            assert isinstance(d, ExpertParallelDispatch)
            assert d.history is not None
            for k, (sent, received) in enumerate(d.history):
                i = d.ep_group.index
                one = ep_bytes_per_layer(sent, received, i, MOE.dim * 8, MOE.moe_experts, ep)
                if rc == "full":  # forward, then recompute forward + backward: 3 row
                    rows = sum(sent) - sent[i] + sum(received) - received[i]  # passes
                    one -= (k % 2 == 0) * rows * MOE.dim * 8  # and 2 counts exchanges
                step_formula += one
                # what I receive from j is what j sends me
                every = torch.zeros(ep, ep, dtype=torch.int64)
                every[d.ep_group.index] = torch.tensor(sent)
                comm.all_reduce(every, d.ep_group, op="sum")
                assert every[:, d.ep_group.index].tolist() == received
        formula.append(step_formula)
        rank_aux = torch.tensor(
            [float(s.aux_loss) for s in pm.experts.stats()], dtype=torch.float64
        )
        comm.all_reduce(rank_aux, mesh.axis("dp", "cp"), op="avg")  # over the data ranks
        aux.append(rank_aux.tolist())
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
    pieces: list[Piece] = [
        (p.name, list(p.shape), p.tp, p.start, p.end, p.value.detach().cpu().clone())
        for p in opt.local_pieces()
        if p.write
    ]
    held = pm.experts.params[0].shape[0]
    return {
        "losses": losses,
        "norms": norms,
        "aux": aux,
        "pieces": pieces,
        "ep_bytes": ep_bytes,
        "formula": formula,
        "held": held,
        "rows_sent": sum(sum(d.last_splits[0]) for d in dispatchers if ep > 1),
        "summary": pm.moe_summary(),  # every stage's MoE layers, on every rank
    }


@pytest.mark.parametrize(
    ("world", "ep", "tp", "zero", "pp", "cp", "rc"),
    [
        pytest.param(2, 2, 1, 0, 1, 1, "none", id="ep2"),
        pytest.param(4, 4, 1, 0, 1, 1, "none", id="ep4"),
        pytest.param(4, 2, 1, 0, 1, 1, "none", id="dp2xep2"),
        pytest.param(4, 2, 2, 0, 1, 1, "none", id="ep2xtp2"),
        pytest.param(4, 2, 1, 0, 2, 1, "none", id="ep2xpp2"),
        pytest.param(2, 1, 1, 0, 2, 1, "none", id="ep1xpp2"),
        pytest.param(4, 4, 1, 0, 1, 2, "none", id="dp2xcp2-ep4"),
        pytest.param(2, 2, 1, 0, 1, 1, "full", id="ep2-recompute-full"),
        pytest.param(2, 1, 1, 3, 1, 1, "none", id="zero3-dp2-ep1"),
        pytest.param(2, 1, 2, 0, 1, 1, "none", id="tp2-ep1"),
    ],
)
def test_matches_one_process(
    pools: Pools,
    ref: dict[str, Any],
    world: int,
    ep: int,
    tp: int,
    zero: int,
    pp: int,
    cp: int,
    rc: str,
) -> None:
    body = "tests.parallel.expert.test_expert_parallel:_body"
    results = pools(world).run(body, ep, tp, zero, pp, cp, rc)
    if pp > 1:  # two micro-batches; stage s holds MoE layer s
        ref = _reference(world // pp, 2)
        for i, res in enumerate(results):
            ref_aux = [[step[i // (world // pp)]] for step in ref["aux"]]
            torch.testing.assert_close(res["aux"], ref_aux, rtol=RTOL, atol=0)
            res["aux"] = ref["aux"]
    for res in results:
        torch.testing.assert_close(res["losses"], ref["losses"], rtol=RTOL, atol=0)
        torch.testing.assert_close(res["norms"], ref["norms"], rtol=RTOL, atol=0)
        torch.testing.assert_close(res["aux"], ref["aux"], rtol=RTOL, atol=0)
        # the metrics' figures: every MoE layer's (all stages'), the one process's
        assert res["summary"].keys() == ref["summary"].keys()
        for key, want_v in ref["summary"].items():
            assert res["summary"][key] == pytest.approx(want_v, rel=RTOL, abs=ATOL), key
        if zero == 0:  # ZeRO-3 frees the gathered weights
            assert res["held"] == MOE.moe_experts // ep
        # traffic: the counted bytes are the formula from the routing counts
        torch.testing.assert_close(res["ep_bytes"], res["formula"], rtol=0, atol=0)
        if ep > 1:
            assert res["rows_sent"] > 0 and all(b > 0 for b in res["ep_bytes"])
    weights = assemble([p for res in results for p in res["pieces"]])
    assert sorted(weights) == sorted(ref["weights"])
    for name, want in ref["weights"].items():
        torch.testing.assert_close(weights[name], want, rtol=RTOL, atol=ATOL, msg=name)


def test_gradient_accumulation_under_ep(pools: Pools) -> None:
    """ep2 with 2 micro-batches per step (the first under no_sync): the one-process
    reference of the same micro-batches (router losses per micro-batch)."""
    body = "tests.parallel.expert.test_expert_parallel:_body"
    results = pools(2).run(body, 2, 1, 0, 1, 1, "none", 2)
    ref = _reference(2, 2)
    for res in results:
        torch.testing.assert_close(res["losses"], ref["losses"], rtol=RTOL, atol=0)
        torch.testing.assert_close(res["norms"], ref["norms"], rtol=RTOL, atol=0)
        torch.testing.assert_close(res["ep_bytes"], res["formula"], rtol=0, atol=0)
    weights = assemble([p for res in results for p in res["pieces"]])
    for name, want in ref["weights"].items():
        torch.testing.assert_close(weights[name], want, rtol=RTOL, atol=ATOL, msg=name)


def _history(ctx: WorkerContext) -> list[Any]:
    """Three ep2 steps with nobody collecting the splits: what each dispatcher kept."""
    mesh = ctx.mesh(dp=ctx.world_size)
    pm = parallelize(_model(), mesh, ParallelConfig(ep=2, bucket_mb=0.01))
    per, r = BATCH // ctx.world_size, mesh.index("dp")
    for x, y in _batches()[:3]:
        pm.step(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])
        pm.zero_grad()
    out = []
    for m in pm.experts.moes:
        d = m.dispatcher
        assert isinstance(d, ExpertParallelDispatch)
        out.append(d.history)
    return out


def test_dispatch_keeps_no_history_by_default(pools: Pools) -> None:
    """The splits of every forward are kept only when a caller asks (a list in
    ``history``): a training run leaves nothing growing per step."""
    for res in pools(2).run("tests.parallel.expert.test_expert_parallel:_history"):
        assert res and all(h is None for h in res)


def _stage_body(ctx: WorkerContext, moe_every: int) -> dict[str, Any]:
    """pp2 (1F1B, 2 micro-batches) of MOE with an MoE layer every ``moe_every`` blocks:
    losses, the last step's router summary and how many MoE layers this stage holds."""
    mesh = ctx.mesh(pp=2)
    model = _model(replace(MOE, moe_every=moe_every))
    pm = parallelize(model, mesh, ParallelConfig(microbatches=2, bucket_mb=0.01))
    opt = Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=LR), max_norm=CLIP)
    losses, summary = [], {}
    for x, y in _batches():
        losses.append(float(pm.step(x, y)))
        summary = pm.moe_summary()
        opt.step()
        opt.zero_grad()
    held = len(pm.experts.moes) if pm.experts is not None else 0  # this stage's
    return {"losses": losses, "summary": summary, "moes": held}


def test_a_pipeline_stage_without_moe_layers_reports_the_other_stages(pools: Pools) -> None:
    """MoE only in block 3 of 4 (moe_every 4): stage 0 holds no MoE layer. Both ranks
    train as one process does and report stage 1's router figures, the one process's
    (float64; the last of 2 micro-batches, as docs/moe.md says); stage 0 keeps no
    reference to stage 1's MoE layer (at ep 1 it used to keep every stage's)."""
    results = pools(2).run("tests.parallel.expert.test_expert_parallel:_stage_body", 4)
    ref = _reference(1, 2, replace(MOE, moe_every=4))
    assert [r["moes"] for r in results] == [0, 1]
    for res in results:
        torch.testing.assert_close(res["losses"], ref["losses"], rtol=RTOL, atol=0)
        assert res["summary"].keys() == ref["summary"].keys()
        for key, want in ref["summary"].items():
            assert res["summary"][key] == pytest.approx(want, rel=RTOL, abs=ATOL), key
