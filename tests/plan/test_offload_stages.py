"""ZeRO-Offload under pipeline parallelism: the planner's host, disk and device bytes per
pipeline stage against the runtime's, per rank.

On 2 (pp2) and 4 (dp2 x pp2) gloo ranks ``parallelize`` splits the model and wraps each
pipeline rank's piece in ZeroDataParallel with ``offload`` (optimizer / params, in host
memory or with the NVMe tier); after one training step and one optimizer step each rank
adds up the storage bytes it holds where the runtime puts them (as
tests/plan/test_offload.py does for one stage: device weights and gradients; host
masters, optimizer state, the ring of landing buffers, the parameter shards with
``params``; disk: its files), and :func:`plait.plan.offload.offload_memory` for its
pipeline stage and shard rank must give the same numbers: equality, no tolerance (on
the CPU nothing is page-locked).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plait.plan.layout import PRECISIONS, Layout
from plait.plan.modelspec import ModelSpec
from plait.plan.offload import offload_memory
from plait.testing import WorkerPool
from tests.plan.test_memory_zero_pp import MODELS
from tests.plan.test_offload import _storage_bytes

M = "tests.plan.test_offload_stages"
SEQ, BATCH, MICRO = 8, 8, 4


def _body(
    ctx: Any, model: str, stage: int, offload: str, schedule: str, folder: str | None
) -> dict[str, int]:
    import torch

    from plait.config import Config, ParallelConfig, TrainConfig
    from plait.model import Transformer
    from plait.optim import Optimizer
    from plait.parallel.parallelize import parallelize

    dp = ctx.world_size // 2
    mesh = ctx.mesh(dp=dp, pp=2)
    odir = None if folder is None else os.path.join(folder, "nvme")
    cfg = Config(
        model=MODELS[model],
        parallel=ParallelConfig(
            dp=dp,
            pp=2,
            zero=stage,
            offload=offload,  # type: ignore[arg-type]
            offload_dir=odir,
            pipeline_schedule=schedule,  # type: ignore[arg-type]
            microbatches=MICRO,
        ),
        train=TrainConfig(global_batch=BATCH, seq_len=SEQ),
    )
    pm = parallelize(Transformer(cfg.model, seed=0), mesh, cfg)
    zdp = pm.zero
    assert pm.pipeline is not None and zdp is not None
    opt = Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=1e-3))
    host_step = opt.sharded.host if opt.sharded is not None else None
    assert host_step is not None
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (BATCH // dp, SEQ), generator=g)
    pm.step(x, x)
    opt.step()
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
    return {
        "pp": mesh.index("pp"),
        "dp": mesh.index("dp"),
        "units": len(zdp.units),
        "device": device,
        "host": host,
        "disk": disk,
    }


CASES = [
    # (world, model, ZeRO stage, offload, schedule, NVMe tier)
    (2, "gqa", 1, "optimizer", "1f1b", False),
    (2, "tied", 2, "optimizer", "gpipe", True),
    (4, "gqa", 2, "optimizer", "1f1b", False),
    (4, "tied", 3, "params", "zb", False),
    (4, "gqa", 3, "params", "1f1b", True),
]


@pytest.mark.parametrize(("world", "model", "stage", "offload", "schedule", "nvme"), CASES)
def test_offload_bytes_per_stage_are_exact(
    pools: Callable[[int], WorkerPool],
    tmp_path: Path,
    world: int,
    model: str,
    stage: int,
    offload: str,
    schedule: str,
    nvme: bool,
) -> None:
    folder = str(tmp_path) if nvme else None
    results = pools(world).run(f"{M}:_body", model, stage, offload, schedule, folder)
    spec = ModelSpec.from_config(MODELS[model])
    dp = world // 2
    layout = Layout(
        dp=dp,
        pp=2,
        zero=stage,
        micro_batch=BATCH // dp // MICRO,
        microbatches=MICRO,
        offload=offload,  # type: ignore[arg-type]
        offload_nvme=nvme,
    )
    assert {(r["pp"], r["dp"]) for r in results} == {(p, d) for p in (0, 1) for d in range(dp)}
    for got in results:
        want = offload_memory(
            spec, layout, PRECISIONS["fp32"], stage=got["pp"], shard_rank=got["dp"], cuda=False
        )
        assert {k: got[k] for k in ("device", "host", "disk")} == {
            "device": want.device, "host": want.host, "disk": want.disk,
        }, f"pp rank {got['pp']}, dp rank {got['dp']}"  # fmt: skip
