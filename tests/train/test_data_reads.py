"""Only the pipeline stages that need data read it (issue 44): under pp4 (and pp2 x dp2)
the first stage reads the inputs, the last the targets, the middle ones zero bytes
(counted by :data:`plait.data.read_count.READ`), the run's report gathers every rank's
bytes, and the losses equal one process's on the same global batches (float32,
relative 1e-5: the pipeline only reorders sums)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from plait import init_mesh
from plait.config import Config
from plait.testing import WorkerContext, WorkerPool
from plait.train.data_reads import data_read_line
from tests.tiny import tiny_config

M = "tests.train.test_data_reads"
STEPS, BATCH, SEQ = 2, 8, 32


def _config(parallel: dict[str, Any]) -> Config:
    cfg = tiny_config(steps=STEPS, parallel=parallel)
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, n_layers=4),
        data=dataclasses.replace(cfg.data, prefetch=0),  # no batch read ahead of the run
    )


def _run(cfg: Config, ctx: WorkerContext | None) -> dict[str, Any]:
    from plait.train.trainer import Trainer

    p = cfg.parallel
    mesh = init_mesh() if ctx is None else ctx.mesh(dp=p.dp, pp=p.pp)
    trainer = Trainer(cfg, mesh, show_progress=False)
    s = trainer.run()
    return {
        "losses": s.losses,
        "bytes": s.data_bytes,
        "item": trainer.train_set.tokens.dtype.itemsize,  # type: ignore[attr-defined]
    }


def _body(ctx: WorkerContext, parallel: dict[str, Any]) -> dict[str, Any]:
    return _run(_config(parallel), ctx)


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    return _run(_config({}), None)


@pytest.mark.parametrize(
    "parallel",
    [{"pp": 4, "dp": 1, "microbatches": 2}, {"pp": 2, "dp": 2, "microbatches": 2}],
    ids=["pp4", "pp2-dp2"],
)
def test_middle_stages_read_nothing(
    pools: Callable[[int], WorkerPool], one_process: dict[str, Any], parallel: dict[str, Any]
) -> None:
    pp, dp = parallel["pp"], parallel["dp"]
    ranks = pools(4).run(f"{M}:_body", parallel)
    item = one_process["item"]
    batches = STEPS + 1  # the steps and the validation batch at the end
    assert one_process["bytes"] == [batches * BATCH * (SEQ + 1) * item]  # both halves
    half = batches * (BATCH // dp) * SEQ * item  # one half of a dp rank's slice
    want = []
    for rank in range(4):  # rank = pp_index * dp + dp_index (pp outermost)
        stage = rank // dp
        want.append(half if stage in (0, pp - 1) else 0)
    assert ranks[0]["bytes"] == want
    assert all(r["bytes"] is None for r in ranks[1:])  # gathered to rank 0 only
    for r in ranks:
        assert r["losses"] == pytest.approx(one_process["losses"], rel=1e-5)


def test_the_report_line() -> None:
    assert data_read_line([1 << 20, 0]) == (
        "plait: data read per rank (tokens and masks): rank 0 1.00 MiB, rank 1 0 B"
    )
    many = data_read_line([0] * 8 + [3 << 20])
    assert many.endswith("least 0 B, most 3.00 MiB")
