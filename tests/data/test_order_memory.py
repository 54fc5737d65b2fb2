"""200 M windows trained on every rank under a memory limit the old data order exceeds.

A mixture of two prepared folders of 100 M windows each (``seq_len`` 8: 800 M uint16
tokens, 1.6 GB a folder) is written as sparse files in milliseconds (the tokens read as
zeros; only their order matters here). Each of the two pool ranks lowers its
``RLIMIT_DATA`` (private writable memory: heap, anonymous maps, thread stacks; read-only
file maps do not count) to what it uses now plus :data:`LIMIT_EXTRA`, trains one dp2 step
of the tiny model on the mixture, and restores the limit. Under the same limit the
order plait drew before issue 44 cannot be built (the control): ``torch.randperm`` of 200 M
windows alone is 1.6 GB (int64) and the whole-merge blend of the mixture some 6 GB.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plait.testing import WorkerContext, WorkerPool
from tests.data.folders import write_prepared

SEQ = 8
WINDOWS = 100_000_000  # per folder: 200 M in the mixture
LIMIT_EXTRA = 160 << 20
M = "tests.data.test_order_memory"


def sparse_folder(root: Path, windows: int) -> None:
    """A prepared folder of ``windows`` windows of ``SEQ + 1`` byte tokens: sparse shard
    files (zeros) of two shards, two documents (the second, 1,000 tokens, is the held-out one)."""
    total = windows * SEQ + 1
    per = -(-total // 2)  # two shards
    write_prepared(root, [per, total - per], [total - 1_000, total])


def _vm_data() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise KeyError("VmData")


def _body(ctx: WorkerContext, spec: str, extra: int) -> dict[str, Any]:
    from plait.config import Config, DataConfig, LogConfig, ModelConfig, TrainConfig
    from plait.data.blending import merged_blend
    from plait.data.order import RandpermOrder
    from plait.train.trainer import Trainer

    cfg = Config(
        model=ModelConfig(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=SEQ),
        train=TrainConfig(steps=1, global_batch=8, seq_len=SEQ, warmup_steps=0, eval_batches=1),
        data=DataConfig(source=spec, val_fraction=0.01),
        log=LogConfig(progress="none", peak_tflops=1.0),
    )
    mesh = ctx.mesh(dp=2)
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (_vm_data() + extra, hard))
    out: dict[str, Any] = {}
    try:
        trainer = Trainer(cfg, mesh, show_progress=False)
        out["windows"] = len(trainer.train_set)
        out["losses"] = trainer.run().losses
        out["mine"] = trainer.sampler.rank_indices(0)
        out["global"] = trainer.sampler.global_indices(0)
        out["order"] = trainer.sampler.state_dict()["order"]
        for name, build in (
            ("randperm", lambda: RandpermOrder(2 * WINDOWS, 0).permutation(0)),
            ("merge", lambda: merged_blend([0.7, 0.3], 2 * WINDOWS)),
        ):
            try:
                build()
                out[name] = "built"
            except (MemoryError, RuntimeError):  # numpy / torch: the allocation refused
                out[name] = "refused"
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    return out


@pytest.fixture(scope="module")
def mixture(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("sparse")
    sparse_folder(root / "a", WINDOWS)
    sparse_folder(root / "b", WINDOWS)
    return f"{root / 'a'}:0.7,{root / 'b'}:0.3"


def test_200m_windows_train_on_every_rank_under_a_limit_the_old_order_exceeds(
    mixture: str, pools: Callable[[int], WorkerPool]
) -> None:
    ranks = pools(2).run(f"{M}:_body", mixture, LIMIT_EXTRA)
    for r in ranks:
        assert r["windows"] == 2 * ((WINDOWS * SEQ - 1_000) // SEQ)  # less the held-out
        assert len(r["losses"]) == 1 and np.isfinite(r["losses"][0])
        assert r["randperm"] == "refused" and r["merge"] == "refused"  # the control
        assert r["order"] == "feistel"
    a, b = ranks[0]["mine"], ranks[1]["mine"]
    assert len(a) == len(b) == 4 and a + b == ranks[0]["global"] == ranks[1]["global"]
