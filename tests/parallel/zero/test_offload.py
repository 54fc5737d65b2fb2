"""ZeRO-Offload and the NVMe tier: the fast CPU step, parity, overlap, bad input.

Parity protocol (as tests/parallel/zero/test_zero.py): the same model, batches and
AdamW (two param groups) trained for STEPS steps under ZeroDataParallel + Optimizer with
and without offload, on 1 and 2 ranks; compared: the loss of every step and every weight
after the last step. The offloaded step runs torch's fused CPU AdamW, which evaluates
the same update in another order: float32 rounding, ~1e-8 relative per step, so losses
rtol 1e-6 and weights atol 1e-6 after 5 steps of lr 1e-3 (clipping on: the clip factor
goes through the same global norm).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.config import Config, ParallelConfig
from plait.errors import ConfigError
from plait.optim import Optimizer
from plait.parallel.zero import ZeroDataParallel
from plait.parallel.zero.cpu_adam import fused_cpu_supported, host_optimizer
from plait.parallel.zero.offload_store import check_offload_dir
from plait.testing import WorkerContext, WorkerPool
from tests.parallel.zero.test_zero import CLIP, _batches, _loss, _make, _optimizer

M = "tests.parallel.zero.test_offload"
STEPS = 5


# ----------------------------------------------------------------------------- CPU AdamW


def test_host_adamw_equals_torch_adamw() -> None:
    """The host optimizer (fused CPU AdamW) equals torch.optim.AdamW after 10 steps:
    fp32, weight decay on one group only, bias correction, 1e-6."""
    assert fused_cpu_supported()
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(1000, generator=g), torch.randn(77, generator=g)]
    grads = [[torch.randn(t.shape, generator=g) for t in init] for _ in range(10)]

    def run(fast: bool) -> list[torch.Tensor]:
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        groups = [
            {"params": [ps[0]], "weight_decay": 0.1},
            {"params": [ps[1]], "weight_decay": 0.0},
        ]
        ref = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
        opt = host_optimizer(ref, [dict(g) for g in groups]) if fast else ref
        assert bool(opt.param_groups[0].get("fused")) == fast
        for gs in grads:
            for p, gr in zip(ps, gs, strict=True):
                p.grad = gr.clone()
            opt.step()
        return [p.detach() for p in ps]

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- parity


def _train(
    ctx: WorkerContext,
    stage: int,
    offload: str,
    clip: float,
    folder: str | None,
    kind: str = "builtin",
) -> dict[str, Any]:
    mesh = ctx.mesh(dp=ctx.world_size)
    model = _make(kind)
    odir = None if folder is None else os.path.join(folder, "state")
    zdp = ZeroDataParallel(model, mesh, stage, offload=offload, offload_dir=odir)  # type: ignore[arg-type]
    opt = Optimizer(zdp, _optimizer(model, "adamw"), max_norm=clip)
    n, r = mesh.size("dp"), mesh.index("dp")
    losses = []
    for x, y in _batches()[:STEPS]:
        per = x.shape[0] // n
        loss = _loss(zdp(x[r * per : (r + 1) * per]), y[r * per : (r + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with zdp.gathered():
        weights = {k: p.detach().clone() for k, p in model.named_parameters()}
    files = 0
    if odir is not None:
        files = sum(f.stat().st_size for f in Path(odir).rglob("*.bin"))
    host = opt.sharded.host if opt.sharded is not None else None
    return {
        "losses": losses,
        "weights": weights,
        "files": files,
        "eager": bool(host and host.eager),
    }


_PLAIN: dict[tuple[int, int, float], list[dict[str, Any]]] = {}

CASES = [
    *[(stage, off, False) for stage, off in [(1, "optimizer"), (2, "optimizer"), (3, "optimizer")]],
    (3, "params", False),
    (2, "optimizer", True),  # the NVMe tier: Adam's state in files
    (3, "params", True),  # and the masters too
]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(("stage", "offload", "nvme"), CASES)
def test_offload_parity(
    pools: Callable[[int], WorkerPool],
    tmp_path: Path,
    world: int,
    stage: int,
    offload: str,
    nvme: bool,
) -> None:
    """Offload (host memory or files) equals no offload: losses every step, weights
    after 5 steps; eager per-unit stepping (no clipping) and after-the-norm (clipping)."""
    clip = CLIP if stage == 2 else 0.0  # stage 2 with clipping: the step after the norm
    folder = str(tmp_path) if nvme else None
    key = (world, stage, clip)
    if key not in _PLAIN:  # the no-offload run, once per layout
        _PLAIN[key] = pools(world).run(f"{M}:_train", stage, "none", clip, None)
    plain = _PLAIN[key]
    off = pools(world).run(f"{M}:_train", stage, offload, clip, folder)
    for a, b in zip(plain, off, strict=True):
        assert b["eager"] == (clip == 0.0)
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-6)
        for k, w in a["weights"].items():
            torch.testing.assert_close(b["weights"][k], w, rtol=0, atol=1e-6)
        assert (b["files"] > 0) == nvme


def test_offload_parity_on_a_model_plait_did_not_write(
    pools: Callable[[int], WorkerPool],
) -> None:
    """A plain torch.nn encoder (test_zero's "encoder": nn.TransformerEncoder layers)
    under ZeRO-2 with optimizer offload at dp2 equals it without offload, with clipping
    (the default path: the step after the norm; the eager path is the same code for any
    model, covered above); same tolerance as above."""
    clip = CLIP
    plain = pools(2).run(f"{M}:_train", 2, "none", clip, None, "encoder")
    off = pools(2).run(f"{M}:_train", 2, "optimizer", clip, None, "encoder")
    for a, b in zip(plain, off, strict=True):
        assert b["eager"] == (clip == 0.0)
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-6)
        for k, w in a["weights"].items():
            torch.testing.assert_close(b["weights"][k], w, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- delayed


def _delayed_reference() -> dict[str, Any]:
    """The one-step-delayed update in plain PyTorch on one process: step k's gradient
    is taken at the weights the device holds (the masters before the previous update),
    then the device receives the masters and the masters step with that gradient."""
    model = _make("builtin")
    master = _make("builtin")
    opt = _optimizer(master, "adamw")
    losses = []
    for x, y in _batches()[:STEPS]:
        loss = _loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p, m in zip(model.parameters(), master.parameters(), strict=True):
                m.grad = p.grad.clone()  # type: ignore[union-attr]
                p.copy_(m)  # the previous update arrives on the device
                p.grad = None
        opt.step()
    return {
        "losses": losses,
        "weights": {k: p.detach().clone() for k, p in master.named_parameters()},
    }


def _undelayed_second_loss() -> float:
    model = _make("builtin")
    opt = _optimizer(model, "adamw")
    (x0, y0), (x1, y1) = _batches()[:2]
    _loss(model(x0), y0).backward()
    opt.step()
    return float(_loss(model(x1), y1).item())


def _delayed(ctx: WorkerContext, stage: int) -> dict[str, Any]:
    mesh = ctx.mesh(dp=ctx.world_size)
    model = _make("builtin")
    zdp = ZeroDataParallel(model, mesh, stage, offload="optimizer", offload_delay=True)
    opt = Optimizer(zdp, _optimizer(model, "adamw"))
    n, r = mesh.size("dp"), mesh.index("dp")
    losses = []
    for x, y in _batches()[:STEPS]:
        per = x.shape[0] // n
        loss = _loss(zdp(x[r * per : (r + 1) * per]), y[r * per : (r + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.flush()  # the last update, still running on the host, reaches the model
    with zdp.gathered():
        weights = {k: p.detach().clone() for k, p in model.named_parameters()}
    return {"losses": losses, "weights": weights}


@pytest.mark.parametrize(("world", "stage"), [(1, 2), (2, 1), (2, 3)])
def test_delayed_update_is_one_step_stale(
    pools: Callable[[int], WorkerPool], world: int, stage: int
) -> None:
    """offload_delay equals the delayed update written out in plain PyTorch (losses
    rtol 1e-5: batch split and fused-kernel rounding; weights atol 1e-5 after 5 steps)."""
    ref = _delayed_reference()
    for res in [pools(world).run(f"{M}:_delayed", stage)]:
        for step in range(STEPS):
            mean = sum(r["losses"][step] for r in res) / world
            assert mean == pytest.approx(ref["losses"][step], rel=1e-5)
        for r in res:
            for k, w in ref["weights"].items():
                torch.testing.assert_close(r["weights"][k], w, rtol=0, atol=1e-5)
    # an undelayed run differs: its step-2 loss is taken after the first update
    assert _undelayed_second_loss() != pytest.approx(ref["losses"][1], rel=1e-5)


# ----------------------------------------------------------------------------- overlap


def _overlap(ctx: WorkerContext, stage: int) -> dict[str, Any]:
    """Block the last gradient of backward (the embedding's) until the first unit's CPU
    step has started: it can only start if a unit was stepped during backward."""
    mesh = ctx.mesh(dp=ctx.world_size)
    model = _make("builtin")
    zdp = ZeroDataParallel(model, mesh, stage, offload="optimizer")
    opt = Optimizer(zdp, _optimizer(model, "adamw"))
    host = opt.sharded.host  # type: ignore[union-attr]
    assert host is not None
    seen: dict[str, Any] = {}

    def last_grad(p: torch.Tensor) -> None:
        seen["started"] = host.started.wait(timeout=60)
        seen["events"] = list(host.events)

    model.tok_embeddings.weight.register_post_accumulate_grad_hook(last_grad)
    x, y = _batches()[0]
    _loss(zdp(x[:4]), y[:4]).backward()
    opt.step()
    return {**seen, "after": list(host.events)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cpu_step_starts_before_backward_ends(
    pools: Callable[[int], WorkerPool], stage: int
) -> None:
    """From the recorded events: the first unit (the output head, first in backward) is
    stepped on the host while backward is still running (before the embedding's gradient,
    the last of backward, is handed over)."""
    for r in pools(2).run(f"{M}:_overlap", stage):
        assert r["started"]
        kinds = [(k, n) for k, n, _ in r["events"]]
        assert ("step_start", "output") in kinds, kinds
        assert all(n != "tok_embeddings" for _, n in kinds)  # its gradient is not in yet
        after = [(k, n) for k, n, _ in r["after"]]
        assert after.index(("landed", "output")) < after.index(("step_start", "output"))
        assert ("step_end", "tok_embeddings") in after


# ----------------------------------------------------------------------------- bad input


def test_offload_without_zero_is_refused(tmp_path: Path) -> None:
    from tests.tiny import run_plait, tiny_args

    with pytest.raises(ConfigError, match="needs ZeRO"):
        Config(parallel=ParallelConfig(offload="optimizer", zero=0)).validate(1)
    with pytest.raises(ConfigError, match="offload_delay need"):
        ParallelConfig(offload_dir=str(tmp_path))
    res = run_plait(
        ["train", *tiny_args(), "--steps", "1", "--parallel.offload", "optimizer"], tmp_path
    )
    assert res.returncode == 2 and "needs ZeRO" in res.stderr, res.stderr


def test_unwritable_or_full_offload_dir_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="not a writable folder"):
        check_offload_dir(blocker / "sub", 10)  # a file where a folder should be
    with pytest.raises(ConfigError, match="GiB free but"):
        check_offload_dir(tmp_path, 1 << 62)
    check_offload_dir(tmp_path / "ok", 1)


def test_cli_refuses_unwritable_offload_dir(tmp_path: Path) -> None:
    """``plait train`` exits 2 before starting when the folder cannot be written."""
    from tests.tiny import run_plait, tiny_args

    (tmp_path / "blocked").write_text("a file, not a folder")
    args = [
        "train",
        *tiny_args(),
        "--steps",
        "1",
        "--parallel.zero",
        "1",
        "--parallel.offload",
        "optimizer",
        "--parallel.offload_dir",
        str(tmp_path / "blocked" / "x"),
    ]
    res = run_plait(args, tmp_path)
    assert res.returncode == 2, res.stderr
    assert "offload_dir" in res.stderr and "not a writable folder" in res.stderr


# ----------------------------------------------------------------------------- CUDA


def _gpu_train(stage: int, offload: str, clip: float, folder: str | None) -> dict[str, Any]:
    from plait import init_mesh

    mesh = init_mesh(device="cuda")
    model = _make("builtin").cuda()
    zdp = ZeroDataParallel(model, mesh, stage, offload=offload, offload_dir=folder)  # type: ignore[arg-type]
    opt = Optimizer(zdp, _optimizer(model, "adamw"), max_norm=clip)
    losses = []
    for x, y in _batches()[:STEPS]:
        loss = _loss(zdp(x.cuda()), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch.cuda.synchronize()
    host = opt.sharded.host if opt.sharded is not None else None
    out: dict[str, Any] = {"losses": losses}
    with zdp.gathered():
        out["weights"] = {k: p.detach().cpu() for k, p in model.named_parameters()}
    if host is not None:
        out["pinned"] = all(g.is_pinned() for g in host.grads)
        out["events"] = [(k, n) for k, n, _ in host.events]
        if offload == "params":
            out["shards_pinned"] = all(zdp.param_shard(u).is_pinned() for u in zdp.units)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("stage", "offload", "clip", "nvme"),
    [(1, "optimizer", 0.0, False), (2, "optimizer", CLIP, False), (3, "params", 0.0, True)],
)
def test_gpu_offload_parity_pinned_side_streams(
    tmp_path: Path, stage: int, offload: str, clip: float, nvme: bool
) -> None:
    """On a GPU: page-locked host buffers, copies on side streams, the same losses and
    weights as without offload (fused CPU AdamW vs the device's AdamW: 1e-5)."""
    plain = _gpu_train(stage, "none", clip, None)
    off = _gpu_train(stage, offload, clip, str(tmp_path / "nvme") if nvme else None)
    assert off["pinned"]
    if offload == "params":
        assert off["shards_pinned"]
    assert ("step_start", "output") in off["events"]
    assert off["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    for k, w in plain["weights"].items():
        torch.testing.assert_close(off["weights"][k], w, rtol=0, atol=1e-5)


def test_a_run_with_the_delayed_update_ends_with_it_applied() -> None:
    """``Trainer.run`` with ``offload_delay``: the last step's host update, still in flight
    when the loop ends, is put in the model (the weights equal the fp32 masters), and the
    host worker is stopped. Without the flush the weights are one update behind."""
    from plait import init_mesh
    from plait.train.trainer import Trainer
    from tests.tiny import tiny_config

    cfg = tiny_config(steps=3, parallel={"zero": 1, "offload": "optimizer", "offload_delay": True})
    cfg.train.eval_every = 0
    tr = Trainer(cfg, init_mesh(), show_progress=False)
    tr.run()
    weights = {n: p.detach().clone() for n, p in tr.base.named_parameters()}  # as left
    host = tr.optimizer.sharded.host  # type: ignore[union-attr]
    assert host is not None and not host.flush()  # nothing left pending
    with pytest.raises(RuntimeError, match="shutdown"):
        host._pool.submit(int)
    for piece in tr.optimizer.local_pieces():  # the fp32 masters, after every update
        torch.testing.assert_close(
            weights[piece.name].reshape(-1), piece.value.reshape(-1), rtol=0, atol=0
        )
