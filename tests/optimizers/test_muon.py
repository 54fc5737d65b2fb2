"""Muon and Adafactor (plait.optimizers) against torch.optim, and sharded against one process.

One process: the trainer's Muon (:func:`plait.train.matrix_optim.make_muon`, stepped by
plait's :class:`~plait.optim.Optimizer`) on the tiny built-in model is bit-equal to
``torch.optim.Muon`` on the hidden matrices plus ``torch.optim.AdamW`` on the rest (the
same kernels run: bf16 Newton-Schulz, float64 weights). Expert stacks equal
``torch.optim.Muon`` per ``(out, in)`` matrix. Sharded: ZeRO 0-3 over dp2 with clipping
and Newton-Schulz in float64 equal one process (losses and weights, 1e-10), and the bytes
the owners gather and scatter equal :func:`~plait.parallel.zero.owners.exchange_bytes`.
The same bodies run Adafactor (:class:`~plait.optimizers.adafactor.ShardedAdafactor`:
row and column sums all-reduced over the shard group and tp) against one process's
``torch.optim.Adafactor``; its all-reduced bytes equal ``2 (n-1)/n · 8 · Σ (R + C + 2)``
over the matrices plus ``2`` elements per vector.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from plait import comm
from plait.cli import main
from plait.config import Config, ModelConfig, TrainConfig
from plait.config.rules.features import check_optimizer
from plait.errors import ConfigError
from plait.model import Transformer
from plait.optim import Optimizer
from plait.optimizers import Muon, split_params
from plait.optimizers.adafactor import ShardedAdafactor, reduce_bytes
from plait.parallel.zero import ZeroDataParallel
from plait.parallel.zero.owners import assign_owners, exchange_bytes
from plait.testing import WorkerContext, WorkerPool
from plait.train.matrix_optim import make_adafactor, make_muon

M = "tests.optimizers.test_muon"
VOCAB, SEQ, BATCH = 64, 8, 4
TOL = 1e-10  # float64 weights and Newton-Schulz: only the order of sums differs


def _model() -> nn.Module:
    cfg = ModelConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ
    )
    return Transformer(cfg, seed=0).double()


def _cfg(ns_dtype: str = "bfloat16", optimizer: str = "muon") -> Config:
    cfg = Config()
    cfg.train.optimizer = optimizer  # type: ignore[assignment]
    cfg.train.lr = 3e-3
    cfg.optim.muon_lr = 0.02
    cfg.optim.muon_ns_dtype = ns_dtype  # type: ignore[assignment]
    return cfg


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(steps)
    ]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def test_one_process_is_torch_muon_plus_adamw_bit_for_bit() -> None:
    """10 steps: plait's Muon through plait's Optimizer == torch.optim.Muon + AdamW."""
    ours, ref = _model(), _model()
    cfg = _cfg()
    opt = Optimizer(ours, make_muon(ours, cfg, cfg.train.lr))
    split = split_params(ref)
    assert {n for n, _ in split.adamw} == {
        "tok_embeddings.weight",
        "output.weight",
        "norm.weight",
        *(f"layers.{i}.{k}_norm.weight" for i in range(2) for k in ("attention", "ffn")),
    }
    muon = torch.optim.Muon([p for _, p in split.muon], lr=0.02)
    adamw = torch.optim.AdamW(
        [
            {"params": [p for _, p in split.adamw if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in split.adamw if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(0.9, 0.95),
    )
    for x, y in _batches(10):
        _loss(ours, x, y).backward()
        opt.step()
        opt.zero_grad()
        _loss(ref, x, y).backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("in_out", [True, False])
def test_expert_stack_is_torch_muon_per_expert(in_out: bool) -> None:
    """A 3-D (experts, ., .) tensor: each expert's (out, in) matrix as torch.optim.Muon
    steps it on its own (float64 weights; bf16 Newton-Schulz on a transposed view)."""
    torch.manual_seed(0)
    w = torch.randn(3, 6, 10, dtype=torch.float64)
    ours = nn.Parameter(w.clone())
    mats = [nn.Parameter((w[e].T if in_out else w[e]).clone()) for e in range(3)]
    opt = Muon([{"params": [ours], "in_out": in_out}], lr=0.02, adjust_lr_fn="match_rms_adamw")
    ref = torch.optim.Muon(mats, lr=0.02, adjust_lr_fn="match_rms_adamw")
    for _ in range(4):
        g = torch.randn_like(w)
        ours.grad = g.clone()
        for e, m in enumerate(mats):
            m.grad = (g[e].T if in_out else g[e]).clone()
        opt.step()
        ref.step()
    for e, m in enumerate(mats):
        got = ours[e].T if in_out else ours[e]
        torch.testing.assert_close(got, m, rtol=0, atol=1e-6)  # bf16 ulp at |update|


def test_adafactor_is_torch_adafactor() -> None:
    ours, ref = _model(), _model()
    cfg = _cfg()
    cfg.train.optimizer = "adafactor"
    opt = Optimizer(ours, make_adafactor(ours, cfg, 3e-3))
    torch_opt = torch.optim.Adafactor(ref.parameters(), lr=3e-3)
    for x, y in _batches(3):
        _loss(ours, x, y).backward()
        opt.step()
        opt.zero_grad()
        _loss(ref, x, y).backward()
        torch_opt.step()
        torch_opt.zero_grad()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_owners_balance_within_one_item() -> None:
    flops = [64, 64, 27, 27, 27, 8, 8, 1, 100]
    for ranks in (2, 3, 4):
        load = [0] * ranks
        for f, r in zip(flops, assign_owners(flops, ranks), strict=True):
            load[r] += f
        assert max(load) - sum(flops) / ranks < max(flops)


def test_bad_input_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"train\.optimizer"):
        TrainConfig(optimizer="lion")  # type: ignore[arg-type]
    cfg = _cfg()
    cfg.parallel.tp = 2
    cfg.validate(2)  # Muon gathers tensor-parallel matrices, Adafactor reduces their sums
    cfg.train.optimizer = "adafactor"
    cfg.validate(2)
    with pytest.raises(ConfigError, match=r"tp = 2 and parallel\.ep = 2"):
        check_optimizer("adafactor", 2, 2, "none", "none", "after")
    for name in ("muon", "adafactor"):  # the host step is AdamW's kernel
        argv = ["--parallel.zero", "1", "--parallel.offload", "optimizer"]
        assert main(["train", "--train.optimizer", name, *argv]) == 2
        assert "AdamW's fused kernel" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no 2-D hidden weight"):
        make_muon(nn.Sequential(nn.Embedding(8, 4), nn.LayerNorm(4)), _cfg(), 1e-3)
    assert main(["train", "--train.optimizer", "lion"]) == 2


def _make(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """The trainer's optimizer of ``cfg.train.optimizer`` (Muon or Adafactor)."""
    make = make_muon if cfg.train.optimizer == "muon" else make_adafactor
    return make(model, cfg, cfg.train.lr)


def _stat_bytes(n: int) -> float:
    """Adafactor's all-reduced bus bytes per step over a shard group of ``n`` (float64):
    ``R + C + 2`` elements per matrix (row and column sums, two squared norms), 2 per
    vector, each all-reduced once (the one-device shapes)."""
    shapes = [p.shape for p in _model().parameters()]
    elements = sum(s[0] + s[1] + 2 if len(s) == 2 else 2 for s in shapes)
    return 2 * (n - 1) / n * 8 * elements


@functools.cache  # the same run for every layout of a test (read, never changed)
def _reference(steps: int, clip: float, optimizer: str = "muon") -> dict[str, Any]:
    model = _model()
    cfg = _cfg("float64", optimizer)
    opt = Optimizer(model, _make(model, cfg), max_norm=clip)
    losses = []
    for x, y in _batches(steps):
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "weights": {k: p.detach().clone() for k, p in model.named_parameters()},
    }


def _body_zero(
    ctx: WorkerContext, stage: int, steps: int, clip: float, optimizer: str
) -> dict[str, Any]:
    mesh = ctx.mesh(dp=ctx.world_size)
    model = _model()
    zdp = ZeroDataParallel(model, mesh, stage)
    cfg = _cfg("float64", optimizer)
    opt = Optimizer(zdp, _make(model, cfg), max_norm=clip)
    n, r = mesh.size("dp"), mesh.index("dp")
    per = BATCH // n
    losses = []
    op = "all_to_all" if optimizer == "muon" else "all_reduce"
    counted = [0.0]
    inner_step = opt.inner.step

    def step() -> None:  # the inner step's traffic only (not the norm's all-reduce)
        before = mesh.stats.get("dp", op).bytes
        inner_step()
        counted[0] += mesh.stats.get("dp", op).bytes - before

    opt.inner.step = step  # type: ignore[method-assign]
    for x, y in _batches(steps):
        loss = _loss(zdp, x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])
        loss.backward()
        t = loss.detach().reshape(1).clone()
        comm.all_reduce(t, mesh.axis("dp"), op="sum")
        opt.step()
        opt.zero_grad()
        losses.append(t.item() / n)
    sent = counted[0]
    assert opt.sharded is not None
    if optimizer == "muon":
        assert opt.sharded.owners is not None
        formula = exchange_bytes(opt.sharded.owners.matrices(), 8) * steps
    else:  # every rank all-reduces the same vectors: the group's count is n times one's
        formula = _stat_bytes(mesh.size("dp") if stage > 0 else 1) * steps * n
        assert isinstance(opt.inner, ShardedAdafactor)
        assert reduce_bytes(opt.inner.held, 8).get("dp", 0.0) * steps * n == formula
    with zdp.gathered():
        weights = {k: p.detach().clone() for k, p in model.named_parameters()}
    return {"losses": losses, "weights": weights, "sent": sent, "formula": formula}


@pytest.mark.parametrize("optimizer", ["muon", "adafactor"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_dp2_equals_one_process(
    pools: Callable[[int], WorkerPool], stage: int, optimizer: str
) -> None:
    """Muon (one owner rank per matrix, Newton-Schulz in float64) and Adafactor (row and
    column sums all-reduced) under ZeRO-{0..3} over dp2, clipping on: losses and weights
    after 4 steps equal one process to 1e-10; the bytes of Muon's owner exchange and of
    Adafactor's all-reduces (summed over the ranks) equal their formulas."""
    steps, clip = 4, 0.5
    ref = _reference(steps, clip, optimizer)
    results = pools(2).run(f"{M}:_body_zero", stage, steps, clip, optimizer)
    for res in results:
        assert res["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL)
        for k, w in ref["weights"].items():
            torch.testing.assert_close(res["weights"][k], w, rtol=TOL, atol=TOL, msg=k)
    # stage 0 replicates (each rank owns every matrix whole): nothing is exchanged
    assert sum(r["sent"] for r in results) == results[0]["formula"]
    assert (results[0]["formula"] > 0) == (stage > 0)
    assert not math.isnan(results[0]["losses"][-1])


def _body_tp(
    ctx: WorkerContext, dp: int, stage: int | None, steps: int, clip: float, optimizer: str
) -> dict[str, Any]:
    """tp2 (plain, no clipping: a plain module's norm is not summed over tp) or dp2 x
    tp2 under ZeRO-``stage``: Muon gathers each tp-cut matrix before Newton-Schulz;
    Adafactor all-reduces its statistics over tp (and the shard group)."""
    from plait.parallel.adafactor import held_whole
    from plait.parallel.tensor.layers import shard_info
    from plait.parallel.tensor.loss import vocab_parallel_loss
    from plait.parallel.tensor.sharding_plan import apply_tensor_parallel, gather_full_state

    mesh = ctx.mesh(dp=dp, tp=2)
    model = apply_tensor_parallel(_model(), mesh, False)
    target: nn.Module = ZeroDataParallel(model, mesh, stage) if stage is not None else model
    cfg = _cfg("float64", optimizer)
    inner: torch.optim.Optimizer
    if optimizer == "muon":
        inner = muon = make_muon(model, cfg, cfg.train.lr)
        muon.tp = (shard_info, mesh.axis("tp"))
    else:  # what make_adafactor builds for a ParallelModel under tp
        params = list(model.parameters())
        inner = ShardedAdafactor(params, held_whole(params, mesh), lr=cfg.train.lr)
    opt = Optimizer(target, inner, max_norm=clip)
    loss_fn = vocab_parallel_loss(mesh, VOCAB)
    per, r = BATCH // dp, mesh.index("dp")
    losses = []
    for x, y in _batches(steps):
        loss = loss_fn(target(x[r * per : (r + 1) * per]), y[r * per : (r + 1) * per])
        loss.backward()
        t = loss.detach().reshape(1).clone()
        if dp > 1:
            comm.all_reduce(t, mesh.axis("dp"), op="sum")
        opt.step()
        opt.zero_grad()
        losses.append(t.item() / dp)
    if isinstance(target, ZeroDataParallel):
        with target.gathered():
            weights = gather_full_state(model, mesh)
    else:
        weights = gather_full_state(model, mesh)
    return {"losses": losses, "weights": weights}


@pytest.mark.parametrize("optimizer", ["muon", "adafactor"])
@pytest.mark.parametrize(("world", "stage", "clip"), [(2, None, 0.0), (4, 1, 0.5), (4, 3, 0.5)])
def test_tensor_parallel_equals_one_process(
    pools: Callable[[int], WorkerPool], world: int, stage: int | None, clip: float, optimizer: str
) -> None:
    """tp2, and dp2 x tp2 under ZeRO-1/3 with clipping: Muon's update of a matrix cut
    over tp is computed from the whole matrix, Adafactor's statistics from the whole
    matrix's sums; losses and weights after 3 steps equal one process (float64, 1e-10)."""
    steps = 3
    ref = _reference(steps, clip, optimizer)
    for res in pools(world).run(f"{M}:_body_tp", world // 2, stage, steps, clip, optimizer):
        assert res["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL)
        for k, w in ref["weights"].items():
            torch.testing.assert_close(res["weights"][k], w, rtol=TOL, atol=TOL, msg=k)
