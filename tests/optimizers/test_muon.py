"""Muon (plait.optimizers) against torch.optim.Muon, and under ZeRO against one process.

One process: the trainer's Muon (:func:`plait.train.matrix_optim.make_muon`, stepped by
plait's :class:`~plait.optim.Optimizer`) on the tiny built-in model is bit-equal to
``torch.optim.Muon`` on the hidden matrices plus ``torch.optim.AdamW`` on the rest (the
same kernels run: bf16 Newton-Schulz, float64 weights). Expert stacks equal
``torch.optim.Muon`` per ``(out, in)`` matrix. Sharded: ZeRO 0-3 over dp2 with clipping
and Newton-Schulz in float64 equal one process (losses and weights, 1e-10), and the bytes
the owners gather and scatter equal :func:`~plait.parallel.zero.owners.exchange_bytes`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from plait import comm
from plait.cli import main
from plait.config import Config, ModelConfig, TrainConfig
from plait.errors import ConfigError
from plait.model import Transformer
from plait.optim import Optimizer
from plait.optimizers import Muon, split_params
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


def _cfg(ns_dtype: str = "bfloat16") -> Config:
    cfg = Config()
    cfg.train.optimizer = "muon"
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


def test_bad_input_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"train\.optimizer"):
        TrainConfig(optimizer="lion")  # type: ignore[arg-type]
    cfg = _cfg()
    cfg.parallel.tp = 2
    cfg.validate(2)  # Muon gathers tensor-parallel matrices; Adafactor does not
    cfg.train.optimizer = "adafactor"
    with pytest.raises(ConfigError, match="tensor-parallel"):
        cfg.validate(2)
    with pytest.raises(ConfigError, match="no 2-D hidden weight"):
        make_muon(nn.Sequential(nn.Embedding(8, 4), nn.LayerNorm(4)), _cfg(), 1e-3)
    assert main(["train", "--train.optimizer", "lion"]) == 2


def _reference(steps: int, clip: float) -> dict[str, Any]:
    model = _model()
    cfg = _cfg("float64")
    opt = Optimizer(model, make_muon(model, cfg, cfg.train.lr), max_norm=clip)
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


def _body_zero(ctx: WorkerContext, stage: int, steps: int, clip: float) -> dict[str, Any]:
    mesh = ctx.mesh(dp=ctx.world_size)
    model = _model()
    zdp = ZeroDataParallel(model, mesh, stage)
    cfg = _cfg("float64")
    opt = Optimizer(zdp, make_muon(model, cfg, cfg.train.lr), max_norm=clip)
    n, r = mesh.size("dp"), mesh.index("dp")
    per = BATCH // n
    losses = []
    before = mesh.stats.get("dp", "all_to_all").bytes
    for x, y in _batches(steps):
        loss = _loss(zdp, x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])
        loss.backward()
        t = loss.detach().reshape(1).clone()
        comm.all_reduce(t, mesh.axis("dp"), op="sum")
        opt.step()
        opt.zero_grad()
        losses.append(t.item() / n)
    sent = mesh.stats.get("dp", "all_to_all").bytes - before
    assert opt.sharded is not None and opt.sharded.owners is not None
    formula = exchange_bytes(opt.sharded.owners.matrices(), 8) * steps
    with zdp.gathered():
        weights = {k: p.detach().clone() for k, p in model.named_parameters()}
    return {"losses": losses, "weights": weights, "sent": sent, "formula": formula}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_dp2_equals_one_process(pools: Callable[[int], WorkerPool], stage: int) -> None:
    """Muon under ZeRO-{0..3} over dp2 (one owner rank per matrix), clipping on, Newton-
    Schulz in float64: losses and weights after 4 steps equal one process to 1e-10; the
    owner exchange's bytes (summed over the ranks) equal the formula."""
    steps, clip = 4, 0.5
    ref = _reference(steps, clip)
    results = pools(2).run(f"{M}:_body_zero", stage, steps, clip)
    for res in results:
        assert res["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL)
        for k, w in ref["weights"].items():
            torch.testing.assert_close(res["weights"][k], w, rtol=TOL, atol=TOL, msg=k)
    # stage 0 replicates (each rank owns every matrix whole): nothing is exchanged
    assert sum(r["sent"] for r in results) == results[0]["formula"]
    assert (results[0]["formula"] > 0) == (stage > 0)
    assert not math.isnan(results[0]["losses"][-1])


def _body_tp(
    ctx: WorkerContext, dp: int, stage: int | None, steps: int, clip: float
) -> dict[str, Any]:
    """tp2 (plain, no clipping: a plain module's norm is not summed over tp) or dp2 x
    tp2 under ZeRO-``stage``: Muon gathers each tp-cut matrix before Newton-Schulz."""
    from plait.parallel.tensor.layers import shard_info
    from plait.parallel.tensor.loss import vocab_parallel_loss
    from plait.parallel.tensor.sharding_plan import apply_tensor_parallel, gather_full_state

    mesh = ctx.mesh(dp=dp, tp=2)
    model = apply_tensor_parallel(_model(), mesh, False)
    target: nn.Module = ZeroDataParallel(model, mesh, stage) if stage is not None else model
    cfg = _cfg("float64")
    muon = make_muon(model, cfg, cfg.train.lr)
    muon.tp = (shard_info, mesh.axis("tp"))
    opt = Optimizer(target, muon, max_norm=clip)
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


@pytest.mark.parametrize(("world", "stage", "clip"), [(2, None, 0.0), (4, 1, 0.5), (4, 3, 0.5)])
def test_tensor_parallel_equals_one_process(
    pools: Callable[[int], WorkerPool], world: int, stage: int | None, clip: float
) -> None:
    """tp2, and dp2 x tp2 under ZeRO-1/3 with clipping: Muon's update of a matrix cut
    over tp is computed from the whole matrix; losses and weights after 3 steps equal
    one process (float64, 1e-10)."""
    steps = 3
    ref = _reference(steps, clip)
    for res in pools(world).run(f"{M}:_body_tp", world // 2, stage, steps, clip):
        assert res["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL)
        for k, w in ref["weights"].items():
            torch.testing.assert_close(res["weights"][k], w, rtol=TOL, atol=TOL, msg=k)
