"""Mixed precision: the loss scaler, skipped steps, bf16 against fp32, device checks.

bf16 tolerance: over 20 AdamW steps of the tiny model (the loss falls from ~3.5 to ~0.2)
the bf16 run (bf16 parameters, activations and gradient reduction; fp32 masters) stays
within 0.02 of the fp32 run's loss at every step (observed: 0.003; bf16 keeps 8
significant bits, a single rounding is up to 0.4%) while differing from it (it really
computes in bf16). bf16 is ~12x slower than fp32 on this CPU, hence the tiny shapes.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from plait import init_mesh
from plait.cli import main
from plait.config import Config, DataConfig, LogConfig, ModelConfig, PrecisionConfig, TrainConfig
from plait.errors import ConfigError
from plait.optim import Optimizer
from plait.parallel import precision
from plait.parallel.checks import validate_run
from plait.parallel.precision import DynamicLossScaler, NonFiniteError, PrecisionPolicy
from plait.parallel.zero import ZeroDataParallel
from plait.testing import WorkerContext, WorkerPool
from plait.train.memory import peak_memory, reset_peak_memory
from plait.train.trainer import Trainer, lr_at

M = "tests.parallel.test_precision"
VOCAB, SEQ, BATCH = 32, 8, 8


def _model() -> nn.Module:
    from plait.model import Transformer

    cfg = ModelConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ
    )
    return Transformer(cfg, seed=0)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, (3 * x + 1) % VOCAB  # a learnable task: a fixed map of the current token


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


# ----------------------------------------------------------------------------- pure


def test_loss_scaler_backs_off_and_grows() -> None:
    s = DynamicLossScaler(init_scale=8.0, growth_interval=3)
    assert s.scale_loss(torch.tensor(2.0)).item() == 16.0
    s.update(False)
    s.update(False)
    assert s.scale == 8.0
    s.update(False)  # third clean step in a row
    assert s.scale == 16.0 and s.clean_steps == 0
    s.update(False)
    s.update(True)  # overflow: halve, restart the count
    assert s.scale == 8.0 and s.clean_steps == 0 and s.skipped_steps == 1
    state = s.state_dict()
    t = DynamicLossScaler()
    t.load_state_dict(state)
    assert t.state_dict() == state
    assert DynamicLossScaler().scale == 65536.0
    with pytest.raises(ValueError):
        DynamicLossScaler(growth_interval=0)


def test_policy_defaults() -> None:
    p = PrecisionPolicy.from_names("bf16")
    assert p.param_dtype == torch.bfloat16 and p.grad_reduce_dtype == torch.bfloat16
    assert p.needs_master_weights and not p.needs_loss_scaling
    q = PrecisionPolicy.from_names("fp16", "fp32")
    assert q.grad_reduce_dtype == torch.float32 and q.needs_loss_scaling
    assert not PrecisionPolicy.from_names("fp32").needs_master_weights


# ----------------------------------------------------------------------------- fp16 scaler


def _snapshot(zdp: ZeroDataParallel, opt: Optimizer) -> dict[str, Any]:
    return {
        "shards": [zdp.param_shard(u).clone() for u in zdp.units],
        "masters": [m.clone() for m in opt.master_tensors()],
        "state": [{k: v.clone() for k, v in st.items()} for st in opt.state.values()],
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    eq = all(torch.equal(x, y) for x, y in zip(a["shards"], b["shards"], strict=True))
    eq &= all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"], strict=True))
    if len(a["state"]) != len(b["state"]):
        return False
    for sa, sb in zip(a["state"], b["state"], strict=True):
        eq &= all(torch.equal(sa[k], sb[k]) for k in sa)
    return bool(eq)


def _body_overflow(ctx: WorkerContext, dtype: str) -> dict[str, Any]:
    """fp16 with the loss scaler, or bf16 with ``nonfinite="skip"``: an inf gradient on one
    rank at step 1 (ZeRO-2, 2 ranks)."""
    mesh = ctx.mesh(dp=ctx.world_size)
    torch.manual_seed(0)
    model = _model()
    zdp = ZeroDataParallel(model, mesh, 2, param_dtype=dtype)
    scaler = DynamicLossScaler(init_scale=2.0**16, growth_interval=3) if dtype == "fp16" else None
    opt = Optimizer(
        zdp, torch.optim.AdamW(model.parameters(), lr=1e-3), scaler=scaler, nonfinite="skip"
    )
    per = BATCH // ctx.world_size
    scales, skipped, unchanged = [], [], []
    for step in range(6):
        x, y = _batch(step)
        sl = slice(ctx.rank * per, (ctx.rank + 1) * per)
        opt.scale_loss(_loss(zdp(x[sl]), y[sl])).backward()
        if step == 1 and ctx.rank == 1:  # an overflow on one rank only
            grad = zdp.units[0].grad_shard
            assert grad is not None
            grad[0] = math.inf
        before = _snapshot(zdp, opt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # bf16: "the step is skipped"
            report = opt.step()
        opt.zero_grad()
        scales.append(report.loss_scale)
        skipped.append(report.skipped)
        unchanged.append(_same(before, _snapshot(zdp, opt)))
    return {
        "scales": scales,
        "after": scaler.scale if scaler is not None else None,
        "skipped": skipped,
        "unchanged": unchanged,
        "steps": opt.steps,
        "dtypes": {str(p.dtype) for p in model.parameters()},
    }


def test_fp16_overflow_skips_the_step_and_the_scale_grows_after_k_clean_steps(
    pools: Callable[[int], WorkerPool],
) -> None:
    for r in pools(2).run(f"{M}:_body_overflow", "fp16"):
        assert r["dtypes"] == {"torch.float16"}
        # step 1 overflows (on rank 1 only; the global norm makes every rank skip)
        assert r["skipped"] == [False, True, False, False, False, False]
        assert r["unchanged"] == [False, True, False, False, False, False]
        k = 2.0**16
        # K = 3 clean steps after the overflow double the halved scale back
        assert r["scales"] == [k, k, k / 2, k / 2, k / 2, k]
        assert r["after"] == k and r["steps"] == 5


def test_bf16_nonfinite_gradient_skips_on_every_rank(pools: Callable[[int], WorkerPool]) -> None:
    """bf16 (no loss scale), ``nonfinite="skip"``: the same injected inf skips the step on
    both ranks and leaves shards, masters and Adam state exactly as they were."""
    for r in pools(2).run(f"{M}:_body_overflow", "bf16"):
        assert r["dtypes"] == {"torch.bfloat16"}
        assert r["skipped"] == [False, True, False, False, False, False]
        assert r["unchanged"] == [False, True, False, False, False, False]
        assert r["scales"] == [None] * 6 and r["steps"] == 5


def _tiny(dtype: str = "fp32", steps: int = 4, **prec: Any) -> Config:
    return Config(
        model=ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16),
        train=TrainConfig(
            steps=steps,
            global_batch=4,
            seq_len=16,
            warmup_steps=2,
            eval_every=0,
            eval_batches=1,
        ),
        precision=PrecisionConfig(dtype=dtype, **prec),  # type: ignore[arg-type]
        data=DataConfig(max_bytes=100_000),
        log=LogConfig(progress="none", peak_tflops=1.0),
    )


def test_trainer_reports_a_skipped_step_and_holds_the_schedule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp16 through the trainer: the step whose loss is made inf is skipped, reported,
    the scale halves, and the learning-rate schedule does not advance."""
    cfg = _tiny("fp16", steps=4, loss_scale_window=2)
    cfg.log.metrics = str(tmp_path / "m.jsonl")
    trainer = Trainer(cfg, init_mesh(), show_progress=False)
    real = trainer.model.loss_fn
    calls = {"n": 0}

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        out = real(x, y)
        return out * math.inf if calls["n"] == 2 else out  # the second step overflows

    monkeypatch.setattr(trainer.model, "loss_fn", loss)
    summary = trainer.run()
    rows = [json.loads(line) for line in Path(cfg.log.metrics).read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [False, True, False, False]
    assert [r["loss_scale"] for r in rows] == [65536.0, 65536.0, 32768.0, 32768.0]
    assert [r["lr"] for r in rows] == [lr_at(i, cfg) for i in (0, 1, 1, 2)]
    assert summary.skipped_steps == 1 and trainer.sched_step == 3
    assert rows[0]["memory"]["master"] > 0 and rows[1]["memory"] is None
    assert trainer.optimizer.scaler is not None and trainer.optimizer.scaler.scale == 65536.0


def _inf_on_second_step(trainer: Trainer, monkeypatch: pytest.MonkeyPatch) -> None:
    real = trainer.model.loss_fn
    calls = {"n": 0}

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        out = real(x, y)
        return out * math.inf if calls["n"] == 2 else out

    monkeypatch.setattr(trainer.model, "loss_fn", loss)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_trainer_nonfinite_loss_skip_keeps_state_and_schedule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """fp32/bf16 with ``nonfinite = "skip"`` (a warning), fp16 through the loss scaler
    (the scale halves): the step with an inf loss is skipped and reported; weights, fp32
    masters, optimizer state and the schedule's step are exactly unchanged."""
    cfg = _tiny(dtype, steps=4, nonfinite="skip")
    cfg.log.metrics = str(tmp_path / "m.jsonl")
    trainer = Trainer(cfg, init_mesh(), show_progress=False)
    _inf_on_second_step(trainer, monkeypatch)
    real_step = trainer.train_step
    same: list[bool] = []

    def state() -> list[torch.Tensor]:
        st = [v.clone() for s in trainer.optimizer.state.values() for v in s.values()]
        masters = [m.clone() for m in trainer.optimizer.master_tensors()]
        return [p.detach().clone() for p in trainer.base.parameters()] + masters + st

    def step(i: int) -> Any:
        before, sched = state(), trainer.sched_step
        out = real_step(i)
        after = state()
        same.append(
            sched == trainer.sched_step
            and len(before) == len(after)
            and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        )
        return out

    monkeypatch.setattr(trainer, "train_step", step)
    if dtype == "fp16":
        summary = trainer.run()
    else:
        with pytest.warns(RuntimeWarning, match="loss is not finite; the step is skipped"):
            summary = trainer.run()
    rows = [json.loads(line) for line in Path(cfg.log.metrics).read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [False, True, False, False]
    assert same == [False, True, False, False]
    assert [r["lr"] for r in rows] == [lr_at(i, cfg) for i in (0, 1, 1, 2)]
    assert summary.skipped_steps == 1 and trainer.sched_step == 3
    k = 65536.0
    scales = [k, k, k / 2, k / 2] if dtype == "fp16" else [None] * 4
    assert [r["loss_scale"] for r in rows] == scales
    assert math.isinf(rows[1]["loss"]) and all(math.isfinite(r["loss"]) for r in rows[2:])


def test_trainer_nonfinite_loss_error_stops_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = Trainer(_tiny("fp32", steps=3), init_mesh(), show_progress=False)
    _inf_on_second_step(trainer, monkeypatch)
    with pytest.raises(NonFiniteError, match=r"optimizer step 2: the loss is not finite"):
        trainer.run()
    assert trainer.sched_step == 1


# ----------------------------------------------------------------------------- bf16


def _body_curve(ctx: WorkerContext, dtype: str) -> dict[str, Any]:
    mesh = ctx.mesh(dp=ctx.world_size)
    torch.manual_seed(0)
    model = _model()
    zdp = ZeroDataParallel(model, mesh, 2, param_dtype=dtype)
    opt = Optimizer(zdp, torch.optim.AdamW(model.parameters(), lr=1e-2), max_norm=1.0)
    per = BATCH // ctx.world_size
    losses = []
    for step in range(20):
        x, y = _batch(step)
        sl = slice(ctx.rank * per, (ctx.rank + 1) * per)
        loss = _loss(zdp(x[sl]), y[sl])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "dtypes": {str(p.dtype) for p in model.parameters()}}


def test_bf16_matches_fp32_within_tolerance(pools: Callable[[int], WorkerPool]) -> None:
    fp32 = pools(2).run(f"{M}:_body_curve", "fp32")
    bf16 = pools(2).run(f"{M}:_body_curve", "bf16")
    assert bf16[0]["dtypes"] == {"torch.bfloat16"}
    a = [sum(r["losses"][i] for r in fp32) / 2 for i in range(20)]
    b = [sum(r["losses"][i] for r in bf16) / 2 for i in range(20)]
    diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
    print(f"bf16 vs fp32: max loss difference {diff:.4f} over 20 steps; {a[-1]:.3f} {b[-1]:.3f}")
    assert diff < 0.02
    assert a != b  # it really ran in bf16
    assert a[-1] < a[0] - 0.3 and b[-1] < b[0] - 0.3  # both learn


def _body_reduce_dtype(ctx: WorkerContext, stage: int, reduce_dtype: str) -> dict[str, Any]:
    mesh = ctx.mesh(dp=ctx.world_size)
    torch.manual_seed(0)
    model = _model()
    zdp = ZeroDataParallel(model, mesh, stage, param_dtype="bf16", reduce_dtype=reduce_dtype)
    opt = Optimizer(zdp, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = _batch(0)
    per = BATCH // ctx.world_size
    mesh.stats.reset()
    _loss(
        zdp(x[ctx.rank * per : (ctx.rank + 1) * per]), y[ctx.rank * per : (ctx.rank + 1) * per]
    ).backward()
    grad_dtypes = {str(zdp.reduced_grad(u).dtype) for u in zdp.units}
    assert not opt.step().skipped
    s = mesh.stats
    return {
        "padded": sum(u.padded for u in zdp.units),
        "rs": s.get("dp", "reduce_scatter").bytes,
        "ag": s.get("dp", "all_gather").bytes,
        "grad_dtypes": grad_dtypes,
        "param_dtypes": {str(p.dtype) for p in model.parameters()},
        "master_dtypes": {str(m.dtype) for m in opt.master_tensors()},
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_reduce_dtype_is_the_dtype_on_the_wire(
    pools: Callable[[int], WorkerPool], stage: int
) -> None:
    """bf16 parameters with fp32 gradient reduction: the reduce-scatter moves 4-byte
    elements, the parameter all-gathers 2-byte ones (bus bytes (N-1)/N·S, exactly); the
    gradient shards are fp32 and the masters fp32."""
    n = 2
    for reduce_dtype, size in (("fp32", 4), ("bf16", 2)):
        for r in pools(n).run(f"{M}:_body_reduce_dtype", stage, reduce_dtype):
            f = (n - 1) / n
            assert r["rs"] == pytest.approx(f * size * r["padded"], rel=1e-12)
            gathers = 2 if stage == 3 else 1  # stage 3: forward and backward gathers
            assert r["ag"] == pytest.approx(gathers * f * 2 * r["padded"], rel=1e-12)
            assert r["grad_dtypes"] == {f"torch.{'float32' if size == 4 else 'bfloat16'}"}
            assert r["param_dtypes"] == {"torch.bfloat16"}
            assert r["master_dtypes"] == {"torch.float32"}


# ----------------------------------------------------------------------------- non-finite


def test_nonfinite_policy_error_or_skip() -> None:
    torch.manual_seed(0)
    model = _model()
    x, y = _batch(0)
    err = Optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    _loss(model(x), y).backward()
    with pytest.raises(NonFiniteError, match=r"loss is not finite.*precision\.nonfinite"):
        err.step(loss_finite=False)
    skip = Optimizer(model, torch.optim.AdamW(model.parameters()), nonfinite="skip")
    first = next(iter(model.parameters()))
    assert first.grad is not None
    first.grad[0] = math.nan  # a NaN gradient with a finite loss
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = skip.step()
    assert report.skipped and "gradient norm" in report.reason
    assert any("skipped" in str(w.message) for w in caught)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert not skip.state  # no optimizer state was created
    # the same with a sharded single-rank wrapper
    zmodel = _model()
    zdp = ZeroDataParallel(zmodel, init_mesh(), 3)
    zopt = Optimizer(zdp, torch.optim.AdamW(zmodel.parameters()), nonfinite="error")
    _loss(zdp(x), y).backward()
    with pytest.raises(NonFiniteError):
        zopt.step(loss_finite=False)


# ----------------------------------------------------------------------------- device checks


def test_fp16_where_the_device_cannot_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    precision.check_device_supports("fp16", "cpu")  # this CPU build can
    monkeypatch.setattr(precision, "_cpu_can_compute", lambda dtype: dtype == torch.float32)
    with pytest.raises(ConfigError, match=r"precision.dtype = 'fp16' cannot run here"):
        validate_run(_tiny("fp16"), 1)
    validate_run(_tiny("fp32"), 1)
    code = main(["train", "--precision.dtype", "fp16", "--nproc", "1", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot run fp16 matmuls" in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_16_bit_on_a_missing_gpu_is_refused() -> None:
    cfg = _tiny("bf16")
    cfg.launch.device = "cuda"
    with pytest.raises(ConfigError, match="no CUDA device is available"):
        validate_run(cfg, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_offload_step_runs_on_the_cpu() -> None:
    """On a GPU: parameters on the device, masters and optimizer state on the CPU."""
    torch.manual_seed(0)
    model = _model().cuda()
    zdp = ZeroDataParallel(model, init_mesh(device="cuda"), 3, param_dtype="bf16", offload="params")
    opt = Optimizer(zdp, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = _batch(0)
    device = torch.device("cuda")
    reset_peak_memory(device)
    _loss(zdp(x.cuda()), y.cuda()).backward()
    assert not opt.step().skipped
    assert {t.device.type for t in opt.master_tensors()} == {"cpu"}
    assert {zdp.param_shard(u).device.type for u in zdp.units} == {"cpu"}
    assert {v.device.type for s in opt.state.values() for v in s.values() if v.dim()} == {"cpu"}
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    peak = peak_memory(device)
    assert peak is not None and peak > 0  # the device reports its peak
