"""ZeRO-2/3 under pipeline parallelism: the planner's bytes against the runtime, per rank.

On 4 gloo ranks (pp2 x dp2), ``parallelize`` wraps each pipeline rank's pieces in
ZeroDataParallel stage 2 or 3 (driven by the schedule); after one training step and one
optimizer step every rank reports its exact state bytes
(:func:`plait.train.memory.memory_report`), which must equal the planner's
(:func:`plait.plan.memory.stage_memory` for its pipeline stage and shard rank) with no
tolerance. The transient bytes of a step (the unsharded gradients held over the
micro-batches, stage 3's gathered pieces) are measured by the driver and must match
:func:`plait.plan.memory.pipeline_zero_buffer_bytes` up to the units' padding, for the
'step' / 'microbatch' and keep / reshard choices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from plait.config import ModelConfig
from plait.plan.layout import PRECISIONS, RUNTIMES, Layout
from plait.plan.memory import pipeline_zero_buffer_bytes, stage_memory, stage_params
from plait.plan.modelspec import ModelSpec
from plait.testing import WorkerPool
from tests.plan.queries import query

M = "tests.plan.test_memory_zero_pp"
SEQ, BATCH, MICRO = 8, 8, 4

MODELS = {
    "gqa": ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16),
    "tied": ModelConfig(
        vocab_size=61, dim=24, n_layers=4, n_heads=2, ffn_dim=50, max_seq_len=16,
        tie_embeddings=True,
    ),
}  # fmt: skip


def _body(
    ctx: Any, model: str, stage: int, schedule: str, chunks: int, reduce: str, reshard: bool
) -> dict[str, int]:
    import torch

    from plait.config import Config, ParallelConfig, TrainConfig
    from plait.model import Transformer
    from plait.optim import Optimizer
    from plait.parallel.parallelize import parallelize
    from plait.train.memory import memory_report

    mesh = ctx.mesh(dp=2, pp=2)
    cfg = Config(
        model=MODELS[model],
        parallel=ParallelConfig(
            dp=2,
            pp=2,
            zero=stage,
            pipeline_schedule=schedule,  # type: ignore[arg-type]
            chunks=chunks,
            microbatches=MICRO,
            pp_grad_reduce=reduce,  # type: ignore[arg-type]
            pp_reshard=reshard,
        ),
        train=TrainConfig(global_batch=BATCH, seq_len=SEQ),
    )
    pm = parallelize(Transformer(cfg.model, seed=0), mesh, cfg)
    assert pm.pipeline is not None and pm.pipeline.zero is not None and pm.zero is not None
    opt = Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (BATCH // 2, SEQ), generator=g)
    pm.step(x, x)
    opt.step()
    b = memory_report(pm, opt, mesh.rank).bytes
    return {
        "pp": mesh.index("pp"),
        "dp": mesh.index("dp"),
        "params": b["params"],
        "grads": b["grads"],
        "master": b["master"],
        "optimizer": b["optimizer"] + b["optimizer_scalars"],
        "peak_grads": pm.pipeline.zero.peak_grad_bytes,
        "peak_gathered": pm.zero.peak_gathered_bytes,
    }


CASES = [
    ("gqa", 2, "1f1b", 1, "step", False),
    ("tied", 2, "zb", 1, "microbatch", False),
    ("gqa", 3, "1f1b", 1, "microbatch", False),
    ("tied", 3, "interleaved", 2, "step", True),
]


@pytest.mark.parametrize(("model", "stage", "schedule", "chunks", "reduce", "reshard"), CASES)
def test_pipeline_zero_state_bytes_are_exact(
    pools: Callable[[int], WorkerPool],
    model: str,
    stage: int,
    schedule: str,
    chunks: int,
    reduce: str,
    reshard: bool,
) -> None:
    results = pools(4).run(f"{M}:_body", model, stage, schedule, chunks, reduce, reshard)
    spec = ModelSpec.from_config(MODELS[model])
    precision = PRECISIONS["fp32"]
    layout = Layout(
        dp=2,
        pp=2,
        zero=stage,
        micro_batch=BATCH // 2 // MICRO,
        microbatches=MICRO,
        schedule="interleaved" if chunks > 1 else "1f1b",
        chunks=chunks,
        pp_grad_reduce=reduce,  # type: ignore[arg-type]
        pp_reshard=reshard,
    )
    for got in results:
        mem = stage_memory(
            query(spec, layout, precision, RUNTIMES["plait"], SEQ), layout, got["pp"], got["dp"]
        )
        want = {"params": mem.params, "grads": mem.grads, "master": mem.master}
        want["optimizer"] = mem.optimizer
        assert {k: got[k] for k in want} == want, f"rank pp{got['pp']} dp{got['dp']}"
        # transients: the model's held gradients and gathered pieces, up to unit padding
        sp = stage_params(spec, layout, got["pp"])
        unit = sp.unit_params * precision.grad_bytes
        model_bytes = pipeline_zero_buffer_bytes(sp, spec, layout, precision, got["pp"])
        measured = got["peak_grads"] + got["peak_gathered"] + 2 * unit
        assert measured == pytest.approx(model_bytes, rel=0.02), f"rank pp{got['pp']}"


def test_planner_prices_the_pipeline_zero_choices() -> None:
    """The trade each choice makes, as the planner sees it (no processes): per-micro-batch
    reduction and resharding hold less memory (one of the v = 2 local pieces) and move
    more bytes."""
    from dataclasses import replace

    from plait.plan.estimate import estimate
    from plait.plan.hardware import hardware_preset

    spec = ModelSpec.from_config(
        ModelConfig(vocab_size=32000, dim=1024, n_layers=16, n_heads=16, max_seq_len=1024)
    )
    hw = hardware_preset("h100-80gb")
    base = Layout(
        dp=4, pp=2, zero=3, micro_batch=1, microbatches=8, schedule="interleaved", chunks=2
    )
    prec, rt = PRECISIONS["bf16-mixed"], RUNTIMES["plait"]

    def run(layout: Layout) -> tuple[float, float]:
        e = estimate(query(spec, layout, prec, rt, 1024, hw), layout)
        return e.memory.buffers, e.time.dp_comm_total

    keep, reshard = run(base), run(replace(base, pp_reshard=True))
    assert reshard[0] < keep[0] and reshard[1] > keep[1]
    step, micro = keep, run(replace(base, pp_grad_reduce="microbatch"))
    assert micro[0] < step[0] and micro[1] > step[1]
    z2 = run(replace(base, zero=2))
    # stage 2 all-gathers once (after the optimizer step): the bytes of stage 3 kept
    assert z2[1] == pytest.approx(keep[1]) and z2[0] < keep[0]
