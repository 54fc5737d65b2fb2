"""ZeRO-Offload's ring of gradient landing buffers: the two-pass step after the norm.

Without eager stepping (clipping on, or fp16 loss scaling) the global norm is taken from
the reduced shards still on the device, and the unscale/clip factors are applied on the
host after each unit lands in the ring (:meth:`HostStep.scale`). Protocol (as
test_offload.py): the same model, batches and AdamW trained STEPS steps with and without
offload on 2 ranks, 16-bit weights (bf16: the norm of the bf16 shards is taken in fp32;
fp16 with a dynamic loss scale: the unscale goes through the host too); compared: the
reported norm and the loss every step (rtol 1e-5: the no-offload norm sums fp32 copies,
the offloaded one the 16-bit shards accumulated in fp32, the same values) and every
weight after the last step (atol 1e-6 on fp32 masters, i.e. the same 16-bit weights).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.config.rules.features import OFFLOAD_RING_BUFFERS
from plait.optim import Optimizer
from plait.parallel.precision import DynamicLossScaler
from plait.parallel.zero import ZeroDataParallel
from plait.testing import WorkerContext, WorkerPool
from tests.parallel.zero.test_zero import CLIP, _batches, _loss, _make, _optimizer

M = "tests.parallel.zero.test_offload_ring"
STEPS = 4


def _train(ctx: WorkerContext, offload: str, dtype: str) -> dict[str, Any]:
    mesh = ctx.mesh(dp=ctx.world_size)
    model = _make("builtin")
    zdp = ZeroDataParallel(model, mesh, 2, param_dtype=dtype, offload=offload)  # type: ignore[arg-type]
    scaler = DynamicLossScaler(init_scale=2.0**10) if dtype == "fp16" else None
    opt = Optimizer(zdp, _optimizer(model, "adamw"), max_norm=CLIP, scaler=scaler)
    n, r = mesh.size("dp"), mesh.index("dp")
    losses, norms = [], []
    for x, y in _batches()[:STEPS]:
        per = x.shape[0] // n
        loss = _loss(zdp(x[r * per : (r + 1) * per]), y[r * per : (r + 1) * per])
        opt.scale_loss(loss).backward()
        report = opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        norms.append(report.grad_norm)
    masters = [t.clone() for t in opt.master_tensors()]
    host = opt.sharded.host if opt.sharded is not None else None
    return {
        "losses": losses,
        "norms": norms,
        "masters": masters,
        "buffers": len(host.grads) if host is not None else 0,
        "eager": bool(host and host.eager),
    }


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_two_pass_step_equals_no_offload(pools: Callable[[int], WorkerPool], dtype: str) -> None:
    plain = pools(2).run(f"{M}:_train", "none", dtype)
    off = pools(2).run(f"{M}:_train", "optimizer", dtype)
    for a, b in zip(plain, off, strict=True):
        assert not b["eager"]  # clipping: the step after the norm, in two passes
        assert b["buffers"] == OFFLOAD_RING_BUFFERS  # a ring, not a buffer per unit
        assert b["norms"] == pytest.approx(a["norms"], rel=1e-5)
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-5)
        assert len(a["masters"]) == len(b["masters"]) > 0
        for x, y in zip(a["masters"], b["masters"], strict=True):
            torch.testing.assert_close(y, x, rtol=0, atol=1e-6)


def test_cli_refuses_offload_beyond_host_memory(tmp_path: Path) -> None:
    """``plait train`` exits 2 with one line before starting when the planner's host
    bytes of the host's ranks exceed the host's memory (here a tiny
    ``launch.host_memory_gb``; the boundary itself: tests/plan/test_offload.py)."""
    from tests.tiny import run_plait, tiny_args

    args = ["train", *tiny_args(), "--steps", "1", "--parallel.zero", "1"]
    args += ["--parallel.offload", "optimizer", "--launch.host_memory_gb", "0.000001"]
    res = run_plait(args, tmp_path)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert "the host needs" in lines[0] and "launch.host_memory_gb" in lines[0], lines[0]
