"""``torch.compile`` per block (``parallelize(..., compile=True)``) against eager.

Every layout runs the same user loop twice on each rank of one 2-rank pool, from the
same seed and the same global batches: eagerly, then with every block compiled by
inductor's C++ backend (``dynamic=False``). Compared on every rank: the loss at every
step and the global gradient norm at every step, and every weight after ``STEPS`` steps.

Tolerance (float32): losses and norms rtol 1e-4 (atol 1e-5), weights rtol 1e-4 and
atol 2e-4. inductor fuses the norms, rotary and SwiGLU element-wise chains into loops
that round differently from eager's one-op-at-a-time float32: losses and norms move by
~1e-6 relative; AdamW (lr 1e-2) turns that into weight differences of up to 4.2e-5
measured (an element whose gradient is near zero takes a step of ~lr whose size depends
on the rounding of m/sqrt(v)), while a real error — a missing gradient, a collective run
twice, a stale ZeRO-3 parameter — moves losses by >= 1e-3 and weights by ~lr = 1e-2.

It also checks that dynamo broke the graphs only at plait's collectives (every recorded
graph break is a ``torch.compiler.disable``d region boundary or attention core, and
there is none without tp or cp).

Layouts: dp2 (2 micro-batches: the bucketed all-reduce hooks), ZeRO-3 dp2 (gather/free
hooks around the compiled forward), tp2 with sequence parallelism (region collectives
are graph breaks), pp2 1F1B (4 micro-batches), cp2 ring attention (the ring core is a
graph break), and dp2 with full and selective recomputation compiled into the block.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plait.config import ModelConfig, ParallelConfig
from plait.model import Transformer
from plait.optim import Optimizer
from plait.parallel.compile import COMPILED_ATTR, apply_compile
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext, WorkerPool
from tests.test_docs import parse_blocks

Pools = Callable[[int], WorkerPool]
STEPS, BATCH, SEQ, VOCAB, LR, CLIP = 5, 4, 8, 64, 1e-2, 0.5
RTOL, ATOL, W_ATOL = 1e-4, 1e-5, 2e-4
TIMEOUT_S = 600.0  # the first run of a layout compiles (tens of seconds on a loaded CPU)
RUN_BY = "tests/parallel/test_compile.py"
CFG = ModelConfig(
    vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=SEQ
)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` global batches ``(BATCH, SEQ)`` of (tokens, targets), seeded."""
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _run(ctx: WorkerContext, layout: dict[str, Any], compiled: bool) -> dict[str, Any]:
    """The user's loop under ``layout`` on one rank: losses, norms, final weights, and
    the graph breaks dynamo recorded (their reasons)."""
    torch._dynamo.utils.counters.clear()
    mesh = ctx.mesh(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], cp=layout["cp"])
    cfg = ParallelConfig(
        microbatches=4, pipeline_schedule="1f1b", bucket_mb=0.005, cp_attention="ring"
    )
    pm = parallelize(
        Transformer(CFG, seed=3),
        mesh,
        cfg,
        zero=layout["zero"],
        sequence_parallel=layout["tp"] > 1,
        recompute=layout["recompute"],
        compile=compiled,
    )
    opt = Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=LR), max_norm=CLIP)
    dp, r = layout["dp"], mesh.index("dp")
    per = BATCH // dp
    losses: list[float] = []
    norms: list[float] = []
    for x, y in _batches():
        xr, yr = x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]
        losses.append(float(pm.step(xr, yr, micro_batches=layout["micro"])))
        norms.append(opt.step().grad_norm)
        opt.zero_grad()
    weights = {p.name: p.value.detach().clone() for p in opt.local_pieces()}
    blocks = sum(bool(getattr(m, COMPILED_ATTR, False)) for m in pm.modules())
    breaks = sorted(torch._dynamo.utils.counters["graph_break"])
    return {
        "losses": losses,
        "norms": norms,
        "weights": weights,
        "blocks": blocks,
        "breaks": breaks,
    }


REGION_BOUNDARIES = (
    "copy_to_region",
    "reduce_from_region",
    "gather_from_region",
    "scatter_to_region",
    "gather_from_sequence",
    "reduce_scatter_to_sequence",
    "scatter_to_sequence",
)
"""plait.comm.regions' differentiable collectives, which dynamo must skip."""


def _at_a_collective(reason: str) -> bool:
    """A graph break at a ``torch.compiler.disable``d attention core, or at a region
    boundary that dynamo skips (``torch._disable_dynamo``'s wrapper, named after it)."""
    if "torch.compiler.disable" in reason:
        return True
    skipped = re.search(r"the function `(\w+)` in file `[^`]*torch/_compile\.py`", reason)
    return skipped is not None and skipped.group(1) in REGION_BOUNDARIES


def _body(ctx: WorkerContext, layout: dict[str, Any]) -> dict[str, Any]:
    """Eager, then compiled, on this rank."""
    return {"eager": _run(ctx, layout, False), "compiled": _run(ctx, layout, True)}


def _layout(
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    zero: int = 0,
    micro: int = 1,
    recompute: str = "none",
) -> dict[str, Any]:
    return {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "zero": zero, "micro": micro,
            "recompute": recompute}  # fmt: skip


LAYOUTS = [
    pytest.param(_layout(dp=2, micro=2), 2, id="dp2-accum2"),
    pytest.param(_layout(dp=2, zero=3, micro=2), 2, id="zero3-dp2-accum2"),
    pytest.param(_layout(tp=2), 2, id="tp2-sp"),
    pytest.param(_layout(pp=2), 1, id="pp2-1f1b-m4"),
    pytest.param(_layout(cp=2), 2, id="cp2-ring"),
    pytest.param(_layout(dp=2, recompute="full"), 2, id="dp2-recompute-full"),
    pytest.param(_layout(dp=2, recompute="selective"), 2, id="dp2-recompute-selective"),
]


@pytest.mark.parametrize(("layout", "blocks"), LAYOUTS)
def test_compiled_matches_eager(pools: Pools, layout: dict[str, Any], blocks: int) -> None:
    """Compiled blocks give eager's losses and norms at every step and its weights after
    ``STEPS`` steps on every rank (float32, tolerances above); every block this rank
    holds is compiled (pp2: one of the two per stage); graph breaks only at collectives."""
    results = pools(2).run(_body, layout, timeout_s=TIMEOUT_S)
    for rank, r in enumerate(results):
        eager, comp = r["eager"], r["compiled"]
        # graph breaks only where a collective stays outside
        assert all(_at_a_collective(b) for b in comp["breaks"]), comp["breaks"]
        assert bool(comp["breaks"]) == (layout["tp"] > 1 or layout["cp"] > 1), rank
        assert eager["blocks"] == 0 and comp["blocks"] == blocks, f"rank {rank}"
        assert comp["losses"] == pytest.approx(eager["losses"], rel=RTOL, abs=ATOL), rank
        assert comp["norms"] == pytest.approx(eager["norms"], rel=RTOL, abs=ATOL), rank
        assert eager["losses"][-1] < eager["losses"][0]  # it trains
        assert sorted(comp["weights"]) == sorted(eager["weights"])
        for name, want in eager["weights"].items():
            torch.testing.assert_close(comp["weights"][name], want, rtol=RTOL, atol=W_ATOL)


def test_compile_one_process_matches_eager_and_refuses_no_blocks() -> None:
    """On one process without a pool: one compiled block gives eager's output and input
    gradient (rtol 1e-5); one graph serves both blocks (compile time does not grow with
    depth); a model without blocks is refused by name."""
    torch._dynamo.reset()  # nothing cached from an earlier test in this process
    torch._dynamo.utils.counters.clear()
    model = Transformer(CFG, seed=1)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    want = model(x)
    F.cross_entropy(want.reshape(-1, VOCAB), x.reshape(-1)).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    assert apply_compile(model) == ["layers.0", "layers.1"]
    got = model(x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # 2 blocks, 1 graph
    F.cross_entropy(got.reshape(-1, VOCAB), x.reshape(-1)).backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, p in zip(grads, [p for p in model.parameters() if p.grad is not None], strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="no block"):
        apply_compile(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/compile.md's example (marked run-by this file) runs and trains; in this
    process it reuses the graph the test above compiled (same block shapes)."""
    page = Path(__file__).resolve().parents[2] / "docs" / "compile.md"
    blocks = [b for b in parse_blocks(page) if b.marker == ("run-by", RUN_BY)]
    assert len(blocks) == 1
    exec(compile(blocks[0].code, str(page), "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert out.startswith("loss ") and math.isfinite(float(out.split()[1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compiled_bf16_step_matches_eager() -> None:
    """On a GPU: bf16 parameters with fp32 masters (the trainer's fused AdamW), blocks
    compiled by inductor (Triton): the losses of 3 steps within 2e-2 relative of eager's
    (bf16 keeps 8 significant bits; fused kernels round differently)."""
    from plait import init_mesh
    from plait.config import Config, TrainConfig
    from plait.train.start import make_optimizer

    mesh = init_mesh(device="cuda")
    cfg = Config(model=CFG, train=TrainConfig(lr=1e-2, warmup_steps=0))
    losses: dict[bool, list[float]] = {}
    for compiled in (False, True):
        model = Transformer(CFG, seed=3).cuda()
        pm = parallelize(model, mesh, precision="bf16", compile=compiled)
        opt = Optimizer(pm, make_optimizer(pm, cfg), max_norm=CLIP)
        assert opt.inner.defaults["fused"] is True
        losses[compiled] = []
        for x, y in _batches()[:3]:
            losses[compiled].append(float(pm.step(x.cuda(), y.cuda())))
            opt.step()
            opt.zero_grad()
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)


def test_compile_on_a_cpu_without_a_compiler_exits_2_in_one_line(tmp_path: Path) -> None:
    """No working C++ compiler for inductor (CXX names none): refused before any rank
    starts, one line, exit 2 (not a traceback from inside the first step)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler")}
    args = ["train", "--device", "cpu", "--steps", "1", "--train.compile", "true"]
    r = subprocess.run(
        [sys.executable, "-m", "plait", *args], env=env, capture_output=True, text=True
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a C++ compiler" in lines[0], lines
