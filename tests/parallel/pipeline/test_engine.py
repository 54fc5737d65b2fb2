"""Pipeline composed with data, ZeRO-1 and tensor parallelism; the trainer end to end.

Parity protocol (as in test_runtime.py): the built-in transformer (8 blocks, 4 heads, 2
KV heads) is built from one seed in float64; the reference runs STEPS AdamW steps in
the pytest process on the whole global batch through :class:`Optimizer` with
global-norm clipping at CLIP (engaged: the first step's norm is above it). Each layout
is prepared by ``parallelize`` (tensor parallelism when tp > 1, the pipeline split, then
``DataParallel`` or ZeRO-1 over dp) and stepped by :class:`plait.optim.Optimizer`
(clipping norm over dp shards, tp and pp from the mesh); each dp rank feeds its
contiguous slice of the global batch to ``ParallelModel.step``. Compared: the
dp-averaged loss at every step, the clipping norm at every step, and every weight after
the last step (tp shards gathered), by one-device name. Tolerance: float64, rtol=1e-9 /
atol=1e-11 (summation order only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from plait.config import Config, ParallelConfig, TrainConfig
from plait.model import Transformer
from plait.optim import Optimizer
from plait.parallel.parallelize import parallelize
from plait.parallel.tensor.sharding_plan import (
    gather_full_state,
)
from plait.testing import WorkerContext, WorkerPool
from tests.parallel.pipeline.test_runtime import (
    BATCH,
    SEQ,
    STEPS,
    batches,
    loss64,
    model_config,
)

M = "tests.parallel.pipeline.test_engine"
CLIP = 0.5
RTOL, ATOL = 1e-9, 1e-11


def reference(
    tied: bool, layers: int = 8, data: list[tuple[torch.Tensor, torch.Tensor]] | None = None
) -> dict[str, object]:
    """One process: AdamW steps with global-norm clipping at CLIP on the whole batches."""
    model = Transformer(model_config(layers, tied=tied), seed=3).double()
    opt = Optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), max_norm=CLIP)
    losses, norms = [], []
    for x, y in batches() if data is None else data:
        loss = loss64(model(x), y)
        loss.backward()
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
        losses.append(loss.item())
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "weights": weights}


def _body_compose(
    ctx: WorkerContext,
    dp: int,
    tp: int,
    schedule: str,
    chunks: int,
    zero: int,
    tied: bool,
    sp: bool = False,
) -> dict[str, object]:
    mesh = ctx.mesh(dp=dp, tp=tp, pp=2)
    par = ParallelConfig(
        dp=dp,
        tp=tp,
        pp=2,
        zero=zero,
        pipeline_schedule=schedule,
        chunks=chunks,
        microbatches=2,
        sequence_parallel=sp,
        bucket_mb=0.01,
    )
    cfg = Config(
        model=model_config(tied=tied),
        parallel=par,
        train=TrainConfig(global_batch=BATCH, seq_len=SEQ, grad_clip=CLIP),
    )
    model = Transformer(cfg.model, seed=3).double()
    pm = parallelize(model, mesh, cfg)
    assert pm.pipeline is not None and pm.stages is not None
    opt = Optimizer(pm, torch.optim.AdamW(model.parameters(), lr=1e-2), max_norm=CLIP)
    per = BATCH // dp
    r = mesh.index("dp")
    losses, norms = [], []
    for x, y in batches():
        loss = pm.step(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])
        losses.append(float(loss))
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
    weights: dict[str, torch.Tensor] = {}
    for piece in pm.stages.chunks:
        weights.update(gather_full_state(piece, mesh))
    return {"losses": losses, "norms": norms, "weights": weights}


@pytest.fixture(scope="module")
def refs() -> dict[bool, dict[str, object]]:
    return {False: reference(False), True: reference(True)}


LAYOUTS = [
    # (world, dp, tp, schedule, chunks, zero, tied, sequence parallel)
    (4, 2, 1, "1f1b", 1, 0, False, False),  # pp2 x dp2, DataParallel
    (4, 2, 1, "interleaved", 2, 1, True, False),  # pp2 x dp2, ZeRO-1, tied embeddings
    (4, 1, 2, "zb", 1, 0, False, False),  # pp2 x tp2
    (4, 1, 2, "interleaved", 2, 0, True, True),  # pp2 x tp2, sequence parallel, tied
    (8, 2, 2, "1f1b", 1, 1, True, False),  # pp2 x tp2 x dp2, ZeRO-1, tied embeddings
]


@pytest.mark.parametrize(("world", "dp", "tp", "schedule", "chunks", "zero", "tied", "sp"), LAYOUTS)
def test_composition_matches_one_process(
    pools: Callable[[int], WorkerPool],
    refs: dict[bool, dict[str, object]],
    world: int,
    dp: int,
    tp: int,
    schedule: str,
    chunks: int,
    zero: int,
    tied: bool,
    sp: bool,
) -> None:
    ref = refs[tied]
    assert ref["norms"][0] > CLIP  # type: ignore[index]  # clipping is engaged
    results = pools(world).run(f"{M}:_body_compose", dp, tp, schedule, chunks, zero, tied, sp)
    for step in range(STEPS):
        for r in results:  # the dp-averaged loss on every rank
            assert r["losses"][step] == pytest.approx(ref["losses"][step], rel=RTOL)  # type: ignore[index]
            assert r["norms"][step] == pytest.approx(ref["norms"][step], rel=RTOL)  # type: ignore[index]
    seen: set[str] = set()
    for r in results:
        for k, w in r["weights"].items():
            torch.testing.assert_close(w, ref["weights"][k], rtol=RTOL, atol=ATOL)  # type: ignore[index]
            seen.add(k)
    assert seen == set(ref["weights"])  # type: ignore[arg-type]


def _metrics(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_pipeline_run_matches_one_process(tmp_path: Path) -> None:
    """`plait train --nproc 2 --pp 2` end to end (1F1B, 4 micro-batches, clipping at
    1.0 engaged): the losses and clipping norms of one process (fp32, rtol 1e-5); the
    measured timeline of the last step is drawn (`--log.timeline`)."""
    from plait.cli import main
    from tests.tiny import tiny_args

    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    tiny = [*tiny_args(), "--steps", "3"]
    png = tmp_path / "timeline.png"
    layout = ["--nproc", "2", "--pp", "2", "--metrics", str(two), "--log.timeline", str(png)]
    assert main(["train", *tiny, "--nproc", "1", "--metrics", str(one)]) == 0
    r = subprocess.run(
        [sys.executable, "-m", "plait", "train", *tiny, *layout],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pipeline 1f1b: pp 2 x chunks 1, 4 micro-batches" in r.stdout
    # the last step's measured timeline: both ranks' 8 compute actions drawn
    assert f"wrote {png} (measured bubble" in r.stdout
    assert png.stat().st_size > 10_000
    want, got = _metrics(one), _metrics(two)
    assert want[0]["grad_norm"] > 1.0
    for key in ("loss", "grad_norm"):
        assert [x[key] for x in got] == pytest.approx([x[key] for x in want], rel=1e-5)
