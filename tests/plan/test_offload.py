"""The planner's offload model against the runtime, and the pre-launch check with offload.

On 1 and 2 gloo ranks ZeroDataParallel with ``offload`` (optimizer / params, in host
memory or with the NVMe tier in a temporary folder) runs one step of AdamW; each rank
adds up the storage bytes it holds where the runtime puts them (device: weights and
gradients; host: masters, optimizer state, the host gradient buffers, the parameter
shards with ``params``; disk: the files) and :func:`plait.plan.offload.offload_memory`
must give the same numbers for that rank: equality, no tolerance (on the CPU nothing is
page-locked, so ``pinned`` is 0 there).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plait.config import Config, ModelConfig, ParallelConfig, TrainConfig
from plait.plan.fit import check_fits
from plait.plan.hardware import PRESETS
from plait.plan.layout import PRECISIONS, RUNTIMES, Layout
from plait.plan.memory import memory_per_rank
from plait.plan.modelspec import ModelSpec
from plait.plan.offload import offload_memory
from plait.testing import WorkerPool
from tests.plan.queries import query
from tests.plan.test_memory_zero import MODELS

M = "tests.plan.test_offload"


def _storage_bytes(ts: list[Any]) -> int:
    seen: dict[int, int] = {}
    for t in ts:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _body(
    ctx: Any, model: str, stage: int, offload: str, dtype: str, folder: str | None
) -> dict[str, int]:
    import torch

    from plait.model import Transformer, lm_loss
    from plait.optim import Optimizer
    from plait.parallel.zero import ZeroDataParallel

    cfg = MODELS[model]
    mesh = ctx.mesh(dp=ctx.world_size)
    base = Transformer(cfg, seed=0)
    odir = None if folder is None else os.path.join(folder, "nvme")
    zdp = ZeroDataParallel(base, mesh, stage, param_dtype=dtype, offload=offload, offload_dir=odir)  # type: ignore[arg-type]
    opt = Optimizer(zdp, torch.optim.AdamW(base.parameters(), lr=1e-3))
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    lm_loss(zdp(x).float(), x).backward()
    opt.step()
    host_step = opt.sharded.host  # type: ignore[union-attr]
    assert host_step is not None
    files = set()
    if host_step.store is not None:
        files = {f.flat.untyped_storage().data_ptr() for f in host_step.store.slots}
    shards = [zdp.param_shard(u) for u in zdp.units]
    grads = [u.grad_full if stage <= 1 else u.grad_shard for u in zdp.units]
    weights = [u.full for u in zdp.units] if stage <= 2 else []
    if stage == 3 and offload == "optimizer":
        weights = shards  # the persistent shards stay on the device
    in_memory = lambda ts: [t for t in ts if t.untyped_storage().data_ptr() not in files]  # noqa: E731
    masters = in_memory(opt.master_tensors())
    state = in_memory([v for st in opt.state.values() for v in st.values()])
    host = _storage_bytes(masters) + _storage_bytes(state) + _storage_bytes(host_step.grads)
    if offload == "params":
        host += _storage_bytes(shards)
    mine = Path(odir or ".") / f"rank{mesh.rank}"
    disk = sum(f.stat().st_size for f in mine.rglob("*.bin")) if odir else 0
    device = _storage_bytes(grads) + _storage_bytes(weights)
    return {"rank": mesh.index("dp"), "device": device, "host": host, "disk": disk}


CASES = [
    (1, "gqa", 1, "optimizer", "fp32", False),
    (2, "gqa", 2, "optimizer", "bf16", False),
    (2, "tied", 3, "optimizer", "fp32", True),
    (2, "gqa", 3, "params", "bf16", False),
    (2, "tied", 3, "params", "fp32", True),
]


@pytest.mark.parametrize(("world", "model", "stage", "offload", "dtype", "nvme"), CASES)
def test_offload_bytes_are_exact(
    pools: Callable[[int], WorkerPool],
    tmp_path: Path,
    world: int,
    model: str,
    stage: int,
    offload: str,
    dtype: str,
    nvme: bool,
) -> None:
    folder = str(tmp_path) if nvme else None
    results = pools(world).run(f"{M}:_body", model, stage, offload, dtype, folder)
    spec = ModelSpec.from_config(MODELS[model])
    precision = PRECISIONS["fp32" if dtype == "fp32" else "bf16-mixed"]
    layout = Layout(dp=world, zero=stage, offload=offload, offload_nvme=nvme)  # type: ignore[arg-type]
    for got in results:
        want = offload_memory(spec, layout, precision, shard_rank=got["rank"], cuda=False)
        assert want.pinned == 0
        assert {k: got[k] for k in ("device", "host", "disk")} == {
            "device": want.device, "host": want.host, "disk": want.disk,
        }, f"rank {got['rank']}"  # fmt: skip
        # the device state the memory model counts is the same
        mem = memory_per_rank(
            query(spec, layout, precision, RUNTIMES["plait"], 8), layout, got["rank"]
        )
        assert mem.params + mem.grads + mem.master + mem.optimizer == want.device


def _seven_b(offload: str, zero: int) -> Config:
    return Config(
        model=ModelConfig(
            dim=4096, n_layers=32, n_heads=32, vocab_size=32000, ffn_dim=11008, max_seq_len=2048
        ),
        parallel=ParallelConfig(zero=zero, offload=offload),  # type: ignore[arg-type]
        train=TrainConfig(global_batch=16, micro_batch=1, seq_len=2048, recompute="full"),
    )


def test_prelaunch_check_accepts_a_layout_that_fits_only_with_offload() -> None:
    """The issue's 7B on one H100: refused without offload, accepted with it; the
    refusal names offload as the change that fits."""
    h100 = PRESETS["h100-80gb"]
    refused = check_fits(_seven_b("none", 2), 1, h100)
    assert not refused.fits
    assert "parallel.offload=optimizer" in refused.message()
    ok = check_fits(_seven_b("optimizer", 2), 1, h100)
    assert ok.fits, ok.message()
    assert ok.estimate.memory.master == 0 and ok.estimate.memory.optimizer == 0


DEEP = ModelConfig(vocab_size=64, dim=32, n_layers=12, n_heads=4, max_seq_len=16)
"""Twelve blocks: 14 ZeRO units, the blocks the largest."""


def _ring_body(ctx: Any, delay: bool, clip: float) -> dict[str, int]:
    import torch

    from plait.model import Transformer, lm_loss
    from plait.optim import Optimizer
    from plait.parallel.zero import ZeroDataParallel

    mesh = ctx.mesh(dp=ctx.world_size)
    base = Transformer(DEEP, seed=0)
    zdp = ZeroDataParallel(base, mesh, 2, offload="optimizer", offload_delay=delay)
    opt = Optimizer(zdp, torch.optim.AdamW(base.parameters(), lr=1e-3), max_norm=clip)
    x = torch.randint(0, DEEP.vocab_size, (2, 8))
    for _ in range(2):
        lm_loss(zdp(x), x).backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    host = opt.sharded.host  # type: ignore[union-attr]
    assert host is not None
    masters = _storage_bytes(opt.master_tensors())
    state = _storage_bytes([v for st in opt.state.values() for v in st.values()])
    return {
        "rank": mesh.index("dp"),
        "units": len(zdp.units),
        "state": masters + state,
        "ring": _storage_bytes(host.grads),
    }


@pytest.mark.parametrize(("delay", "clip"), [(False, 0.0), (False, 1.0), (True, 0.0)])
def test_host_bytes_are_masters_state_and_a_ring(
    pools: Callable[[int], WorkerPool], delay: bool, clip: float
) -> None:
    """Host bytes per rank = masters + optimizer state + the landing buffers, equal to
    the planner's; the ring (eager or the two-pass step after the norm) keeps the host
    within 1.1x of masters + state for a model of >= 10 units, the one-step-delayed
    update holds a full fp32 gradient (4 of 16 bytes: ~1.33x)."""
    spec = ModelSpec.from_config(DEEP)
    layout = Layout(dp=2, zero=2, offload="optimizer", offload_delay=delay)
    for got in pools(2).run(f"{M}:_ring_body", delay, clip):
        assert got["units"] >= 10
        want = offload_memory(spec, layout, PRECISIONS["fp32"], shard_rank=got["rank"], cuda=False)
        assert got["state"] + got["ring"] == want.host, f"rank {got['rank']}"
        ratio = want.host / got["state"]
        if delay:
            assert ratio > 1.3
        else:
            assert ratio <= 1.1, ratio


def test_host_memory_check_refuses_exactly_above_the_planned_bytes() -> None:
    """The pre-launch host check: the issue's 7B with optimizer offload on one rank
    needs the planner's host bytes (masters + state + ring: ~1.0x of 12 B/param); a
    host with exactly that passes, one byte less is refused naming offload_dir; the NVMe
    tier needs less host memory."""
    from plait.errors import ConfigError
    from plait.plan.fit import plan_inputs
    from plait.plan.offload import host_bytes
    from plait.plan.offload_check import refuse_host_overflow

    cfg = _seven_b("optimizer", 2)
    spec, layout, precision, _ = plan_inputs(cfg, 1)
    need = int(host_bytes(spec, layout, precision))
    assert 12 * 6.7e9 < need < 1.1 * 12 * 6.8e9  # masters + Adam + a ring of 2 units
    refuse_host_overflow(cfg, 1, 1, (need, "MemTotal"))
    with pytest.raises(ConfigError, match=r"parallel\.offload_dir"):
        refuse_host_overflow(cfg, 1, 1, (need - 1, "MemTotal"))
    with pytest.raises(ConfigError, match=r"2 rank\(s\)"):  # two ranks on the host
        refuse_host_overflow(cfg, 2, 2, (need, "MemTotal"))
    cfg.parallel.offload_dir = "/tmp/nvme"
    spec, layout, precision, _ = plan_inputs(cfg, 1)
    assert host_bytes(spec, layout, precision) < need / 2  # m and v in files, masters not
