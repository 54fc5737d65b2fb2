"""ZeRO-Offload under pipeline parallelism against one process.

Protocol (as tests/parallel/pipeline/test_zero_pipeline.py): the built-in transformer
(4 blocks, float64, one seed); the reference runs STEPS AdamW steps on the whole global
batch in the pytest process (clipping at CLIP where the case clips, engaged: the first
step's norm is above it). Each layout is prepared by ``parallelize`` with
``parallel.offload`` (pipeline split, then ``ZeroDataParallel`` whose masters and Adam
state live on the host; stages 2/3 driven by the schedule) and stepped by
:class:`plait.optim.Optimizer`; each dp rank feeds its slice of the global batch.
Compared: the loss and the gradient norm at every step and every weight after the last
step. The offloaded
step runs torch's fused CPU AdamW, which evaluates the same update in another order:
losses rtol 1e-6 and weights atol 1e-6 after 5 steps (the tolerance of
tests/parallel/zero/test_offload.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.config import Config, ParallelConfig, TrainConfig
from plait.model import Transformer
from plait.optim import Optimizer
from plait.parallel.parallelize import parallelize
from plait.parallel.tensor.sharding_plan import gather_full_state
from plait.testing import WorkerContext, WorkerPool
from tests.parallel.pipeline.test_runtime import BATCH, SEQ, loss64, model_config
from tests.parallel.pipeline.test_runtime import batches as runtime_batches

M = "tests.parallel.zero.test_offload_pipeline"
STEPS, LAYERS, MICRO = 5, 4, 4
CLIP = 0.5
RTOL, ATOL = 1e-6, 1e-6


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return runtime_batches(STEPS, seed=11)


def reference(clip: float) -> dict[str, Any]:
    """One process, whole batches, float64, AdamW (clipping at ``clip``; 0: none)."""
    model = Transformer(model_config(LAYERS), seed=3).double()
    opt = Optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), max_norm=clip)
    losses, norms = [], []
    for x, y in batches():
        loss = loss64(model(x), y)
        loss.backward()
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
        losses.append(loss.item())
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "weights": weights}


def _body(
    ctx: WorkerContext,
    dp: int,
    zero: int,
    offload: str,
    schedule: str,
    chunks: int,
    clip: float,
    folder: str | None,
    delay: bool = False,
    reduce: str = "step",
    tp: int = 1,
) -> dict[str, Any]:
    mesh = ctx.mesh(dp=dp, pp=2, tp=tp)
    odir = None if folder is None else os.path.join(folder, "state")
    par = ParallelConfig(
        dp=dp,
        pp=2,
        tp=tp,
        zero=zero,
        offload=offload,  # type: ignore[arg-type]
        offload_dir=odir,
        offload_delay=delay,
        pipeline_schedule=schedule,
        chunks=chunks,
        microbatches=MICRO,
        pp_grad_reduce=reduce,  # type: ignore[arg-type]
        pp_reshard=reduce == "microbatch",  # the two go together in these cases
    )
    cfg = Config(
        model=model_config(LAYERS),
        parallel=par,
        train=TrainConfig(global_batch=BATCH, seq_len=SEQ, grad_clip=clip),
    )
    model = Transformer(cfg.model, seed=3).double()
    pm = parallelize(model, mesh, cfg)
    assert pm.pipeline is not None and pm.stages is not None and pm.zero is not None
    opt = Optimizer(pm, torch.optim.AdamW(model.parameters(), lr=1e-2), max_norm=clip)
    host = opt.sharded.host if opt.sharded is not None else None
    assert host is not None
    per = BATCH // dp
    r = mesh.index("dp")  # tp ranks of one dp rank feed the same slice
    losses, norms = [], []
    for x, y in batches():
        loss = pm.step(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])
        losses.append(float(loss))
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
    opt.flush()  # delayed: the last update, still on the host, reaches the model
    weights: dict[str, torch.Tensor] = {}
    with pm.zero.gathered():
        for piece in pm.stages.chunks:
            weights.update(gather_full_state(piece, mesh))  # tp shards gathered
    files = 0
    if odir is not None:
        files = sum(f.stat().st_size for f in Path(odir).rglob("*.bin"))
    return {
        "losses": losses,
        "norms": norms,
        "weights": weights,
        "files": files,
        "events": [(k, n) for k, n, _ in host.events],
        "eager": host.eager,
    }


_REFS: dict[float, dict[str, Any]] = {}


def _ref(clip: float) -> dict[str, Any]:
    if clip not in _REFS:
        _REFS[clip] = reference(clip)
    return _REFS[clip]


LAYOUTS = [
    # (world, dp, zero, offload, schedule, chunks, clip, nvme, pp_grad_reduce)
    (2, 1, 1, "optimizer", "1f1b", 1, 0.0, False, "step"),  # pp2 x ZeRO-1, eager
    (2, 1, 1, "optimizer", "1f1b", 1, CLIP, False, "step"),  # clipping: two passes
    (2, 1, 2, "optimizer", "interleaved", 2, CLIP, True, "step"),  # + the NVMe tier
    (4, 2, 2, "optimizer", "1f1b", 1, 0.0, False, "step"),  # dp2 x pp2 x ZeRO-2
    (4, 2, 3, "params", "zb", 1, CLIP, False, "step"),  # dp2 x pp2 x ZeRO-3 params
    (4, 2, 1, "optimizer", "gpipe", 1, CLIP, False, "step"),
    (4, 2, 3, "optimizer", "1f1b", 1, 0.0, False, "step"),  # ZeRO-3, shards on the device
    # ZeRO-3 params, interleaved: gradients reduce-scattered after every backward action,
    # the host-resident shards re-gathered for every action (pp_reshard)
    (4, 2, 3, "params", "interleaved", 2, CLIP, False, "microbatch"),
]


@pytest.mark.parametrize(
    ("world", "dp", "zero", "offload", "schedule", "chunks", "clip", "nvme", "reduce"), LAYOUTS
)
def test_offload_pipeline_matches_one_process(
    pools: Callable[[int], WorkerPool],
    tmp_path: Path,
    world: int,
    dp: int,
    zero: int,
    offload: str,
    schedule: str,
    chunks: int,
    clip: float,
    nvme: bool,
    reduce: str,
) -> None:
    ref = _ref(clip)
    if clip:
        assert ref["norms"][0] > clip  # clipping is engaged
    folder = str(tmp_path) if nvme else None
    results = pools(world).run(
        f"{M}:_body", dp, zero, offload, schedule, chunks, clip, folder, False, reduce
    )
    for step in range(STEPS):
        for r in results:
            assert r["losses"][step] == pytest.approx(ref["losses"][step], rel=RTOL)
            assert r["norms"][step] == pytest.approx(ref["norms"][step], rel=RTOL)
    seen: set[str] = set()
    for r in results:
        for k, w in r["weights"].items():
            torch.testing.assert_close(w, ref["weights"][k], rtol=0, atol=ATOL)
            seen.add(k)
        assert (r["files"] > 0) == nvme
    assert seen == set(ref["weights"])


def delayed_reference() -> dict[str, Any]:
    """The one-step-delayed update in plain PyTorch, one process, float64 (as
    tests/parallel/zero/test_offload.py): step k's gradient is taken at the weights the
    device holds, then the device receives the masters and the masters step with it."""
    model = Transformer(model_config(LAYERS), seed=3).double()
    master = Transformer(model_config(LAYERS), seed=3).double()
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    losses = []
    for x, y in batches():
        loss = loss64(model(x), y)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p, m in zip(model.parameters(), master.parameters(), strict=True):
                m.grad = p.grad.clone()  # type: ignore[union-attr]
                p.copy_(m)  # the previous update arrives on the device
                p.grad = None
        opt.step()
    return {"losses": losses, "weights": {k: v.detach() for k, v in master.state_dict().items()}}


@pytest.mark.parametrize(("world", "dp", "zero"), [(2, 1, 1), (4, 2, 3)])
def test_delayed_offload_pipeline_is_one_step_stale(
    pools: Callable[[int], WorkerPool], world: int, dp: int, zero: int
) -> None:
    """``offload_delay`` under pp equals the delayed rule written out on one process:
    losses every step, weights after the last update is flushed (1e-6)."""
    ref = delayed_reference()
    offload = "params" if zero == 3 else "optimizer"
    results = pools(world).run(f"{M}:_body", dp, zero, offload, "1f1b", 1, 0.0, None, True)
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=RTOL)
        for k, w in r["weights"].items():
            torch.testing.assert_close(w, ref["weights"][k], rtol=0, atol=ATOL)


def test_cli_pp2_dp2_zero2_offload_matches_one_process(tmp_path: Path) -> None:
    """`plait train --nproc 4 --pp 2 --dp 2 --zero 2 --parallel.offload optimizer` end to
    end (the trainer's default clipping: the two-pass host step on every pipeline rank),
    2 steps, a checkpoint, then 2 more steps resumed from it: the losses and clipping norms
    of 4 steps of one process without offload (fp32, rtol 1e-5)."""
    from plait.cli import main
    from tests.tiny import read_metrics, run_plait, tiny_args

    one, four = tmp_path / "one.jsonl", tmp_path / "four.jsonl"
    assert main(["train", *tiny_args(), "--steps", "4", "--nproc", "1", "--metrics", str(one)]) == 0
    layout = ["--nproc", "4", "--pp", "2", "--dp", "2", "--zero", "2"]
    layout += ["--parallel.offload", "optimizer", "--train.checkpoint_dir", str(tmp_path / "ck")]
    got = []
    for k, extra in enumerate([["--steps", "2"], ["--steps", "4", "--resume"]]):
        metrics = four.with_suffix(f".{k}.jsonl")
        r = run_plait(
            ["train", *tiny_args(), *layout, *extra, "--metrics", str(metrics)], tmp_path, 300
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert "offload optimizer" in r.stdout and "pipeline 1f1b: pp 2" in r.stdout
        got += read_metrics(metrics)
    want = read_metrics(one)
    assert [x["step"] for x in got] == [x["step"] for x in want] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        assert [x[key] for x in got] == pytest.approx([x[key] for x in want], rel=1e-5)


def test_offload_pipeline_tensor_parallel_matches_one_process(
    pools: Callable[[int], WorkerPool],
) -> None:
    """tp2 x pp2 x ZeRO-1 (dp 1: the masters unsharded, on the host), clipping: each tp
    rank offloads its tp shards of its stage's pieces; losses, norms and the gathered
    weights equal one process (1e-6)."""
    ref = _ref(CLIP)
    results = pools(4).run(f"{M}:_body", 1, 1, "optimizer", "1f1b", 1, CLIP, None, False, "step", 2)
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=RTOL)
        assert r["norms"] == pytest.approx(ref["norms"], rel=RTOL)
        for k, w in r["weights"].items():
            torch.testing.assert_close(w, ref["weights"][k], rtol=0, atol=ATOL)
    assert {k for r in results for k in r["weights"]} == set(ref["weights"])
