"""ZeRO-2 and ZeRO-3 under pipeline parallelism (pp2 x dp2) against one process.

Protocol as in test_engine.py: the built-in transformer (4 blocks, float64, one seed);
the reference runs STEPS AdamW steps with global-norm clipping at CLIP (engaged) on the
whole global batch in the pytest process. Each layout is prepared by ``parallelize``
(pipeline split, then ``ZeroDataParallel`` stage 2 or 3 driven by the schedule:
:class:`plait.parallel.pipeline.zero.PipelineZero`) and stepped by
:class:`plait.optim.Optimizer`; each dp rank feeds its slice of the global batch.
Compared: the dp-averaged loss and the clipping norm at every step, and every weight after
the last step (gathered under ``ZeroDataParallel.gathered``). Tolerance: float64,
rtol=1e-9 / atol=1e-11 (summation order only). The driver's counters check the chosen
trade: one reduce-scatter per unit and step ('step') or one per backward action
('microbatch'); stage 3 gathers once per unit and step, or per action when resharding.
The dp bus bytes of every step, from the comm counters, equal (N-1)/N of the padded
units' bytes per reduce-scatter and all-gather, exactly. The driver is chosen once: a
wrapper the schedule drives never builds the autograd driver nor installs its hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

from plait.config import Config, ParallelConfig, TrainConfig
from plait.model import Transformer
from plait.optim import Optimizer
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext, WorkerPool
from tests.parallel.pipeline.test_engine import CLIP
from tests.parallel.pipeline.test_engine import reference as engine_reference
from tests.parallel.pipeline.test_runtime import BATCH, SEQ, model_config
from tests.parallel.pipeline.test_runtime import batches as runtime_batches

M = "tests.parallel.pipeline.test_zero_pipeline"
STEPS, LAYERS, MICRO = 5, 4, 4
RTOL, ATOL = 1e-9, 1e-11


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return runtime_batches(STEPS, seed=11)


def reference(tied: bool) -> dict[str, object]:
    return engine_reference(tied, LAYERS, batches())


def _body(
    ctx: WorkerContext,
    zero: int,
    schedule: str,
    chunks: int,
    reduce: str,
    reshard: bool,
    tied: bool,
) -> dict[str, object]:
    mesh = ctx.mesh(dp=2, pp=2)
    par = ParallelConfig(
        dp=2,
        pp=2,
        zero=zero,
        pipeline_schedule=schedule,
        chunks=chunks,
        microbatches=MICRO,
        pp_grad_reduce=reduce,  # type: ignore[arg-type]
        pp_reshard=reshard,
    )
    cfg = Config(
        model=model_config(LAYERS, tied=tied),
        parallel=par,
        train=TrainConfig(global_batch=BATCH, seq_len=SEQ, grad_clip=CLIP),
    )
    model = Transformer(cfg.model, seed=3).double()
    pm = parallelize(model, mesh, cfg)
    assert pm.pipeline is not None and pm.stages is not None and pm.zero is not None
    driver = pm.pipeline.zero
    assert driver is not None and pm.zero.stage == zero
    opt = Optimizer(pm, torch.optim.AdamW(model.parameters(), lr=1e-2), max_norm=CLIP)
    per = BATCH // 2
    r = mesh.index("dp")
    losses, norms, counts, traffic = [], [], [], []
    for x, y in batches():
        before = (driver.reductions, driver.gathers)
        mesh.stats.reset()
        loss = pm.step(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])
        counts.append((driver.reductions - before[0], driver.gathers - before[1]))
        assert pm.zero.gathered_bytes == 0  # stage 3: only shards between steps
        losses.append(float(loss))
        norms.append(opt.step().grad_norm)  # stage 2: launches the post-step all-gathers
        opt.zero_grad()
        s = mesh.stats
        traffic.append(
            {
                op: (s.get("dp", op).bytes, s.get("dp", op).calls)
                for op in ("reduce_scatter", "all_gather")
            }
        )
    # a state_dict right after the step (stage 2's all-gathers still in flight) reads the
    # updated parameters: it completes the gathers first
    direct = {k: v.clone() for c in pm.stages.chunks for k, v in c.state_dict().items()}
    weights: dict[str, torch.Tensor] = {}
    with pm.zero.gathered():
        for piece in pm.stages.chunks:
            weights.update({k: v.detach().clone() for k, v in piece.state_dict().items()})
    if zero == 2:
        assert direct.keys() == weights.keys()
        assert all(torch.equal(direct[k], weights[k]) for k in weights)
    actions = pm.pipeline.schedule.actions[mesh.index("pp")]
    # reduce-scatters per step if each backward action reduced its piece's own units
    own = {
        s: [u for u in us if u.index not in driver.deferred] for s, us in driver.units_of.items()
    }
    per_action = sum(len(own[a.stage]) for a in actions if a.op.value in ("B", "W"))
    padded = {u.index: u.padded for u in pm.zero.units}  # elements, padded to dp
    per_action_numel = sum(
        padded[u.index] for a in actions if a.op.value in ("B", "W") for u in own[a.stage]
    ) + sum(padded[i] for i in driver.deferred)
    return {
        "losses": losses,
        "norms": norms,
        "weights": weights,
        "counts": counts,
        "units": len(pm.zero.units),
        "deferred": len(driver.deferred),
        "per_action": per_action + len(driver.deferred),
        "traffic": traffic,
        "padded": sum(padded.values()),
        "per_action_numel": per_action_numel,
    }


@pytest.fixture(scope="module")
def refs() -> dict[bool, dict[str, object]]:
    return {False: reference(False), True: reference(True)}


LAYOUTS = [
    # (zero, schedule, chunks, pp_grad_reduce, pp_reshard, tied)
    (2, "1f1b", 1, "step", False, True),
    (2, "interleaved", 2, "microbatch", False, False),
    (2, "zb", 1, "step", False, False),
    (3, "1f1b", 1, "microbatch", True, False),
    (3, "interleaved", 2, "step", False, True),
    (3, "interleaved", 2, "microbatch", True, False),
    (3, "zb", 1, "step", True, True),
]


@pytest.mark.parametrize(("zero", "schedule", "chunks", "reduce", "reshard", "tied"), LAYOUTS)
def test_zero_pipeline_matches_one_process(
    pools: Callable[[int], WorkerPool],
    refs: dict[bool, dict[str, object]],
    zero: int,
    schedule: str,
    chunks: int,
    reduce: str,
    reshard: bool,
    tied: bool,
) -> None:
    ref = refs[tied]
    assert ref["norms"][0] > CLIP  # type: ignore[index]  # clipping is engaged
    results = pools(4).run(f"{M}:_body", zero, schedule, chunks, reduce, reshard, tied)
    for step in range(STEPS):
        for r in results:
            assert r["losses"][step] == pytest.approx(ref["losses"][step], rel=RTOL)
            assert r["norms"][step] == pytest.approx(ref["norms"][step], rel=RTOL)
    seen: set[str] = set()
    for r in results:
        for k, w in r["weights"].items():
            torch.testing.assert_close(w, ref["weights"][k], rtol=RTOL, atol=ATOL)  # type: ignore[index]
            seen.add(k)
    assert seen == set(ref["weights"])  # type: ignore[arg-type]
    for r in results:  # the trade chosen: reductions and gathers per step
        units = r["units"]
        want_reduce = units if reduce == "step" else r["per_action"]
        for reductions, gathers in r["counts"]:
            assert reductions == want_reduce
            if zero == 2:
                assert gathers == 0
            elif not reshard or chunks == 1:  # one piece per rank: it stays gathered
                assert gathers == units
            else:  # the schedule alternates the rank's pieces: re-gathered
                assert gathers > units
    # bus bytes on dp per step from the comm counters (float64, dp = 2: (N-1)/N = 1/2 of
    # the padded bytes per ReduceScatter / AllGather, as SPEC's cost model)
    f, item = 0.5, 8
    for r in results:
        s_pad = item * r["padded"]
        rs_numel = r["padded"] if reduce == "step" else r["per_action_numel"]
        for (reductions, gathers), t in zip(r["counts"], r["traffic"], strict=True):
            rs_bytes, rs_calls = t["reduce_scatter"]
            ag_bytes, ag_calls = t["all_gather"]
            assert rs_calls == reductions
            assert rs_bytes == pytest.approx(f * item * rs_numel, rel=1e-12)
            if zero == 2 or not reshard or chunks == 1:  # every unit gathered once a step
                assert ag_bytes == pytest.approx(f * s_pad, rel=1e-12)
            else:
                assert ag_calls == gathers and ag_bytes > f * s_pad


def _spy(owner: type, name: str) -> Any:
    """Patch ``owner.name`` with a mock that counts its calls and runs the original."""
    return mock.patch.object(owner, name, autospec=True, side_effect=getattr(owner, name))


def _body_hooks(ctx: WorkerContext) -> dict[int, dict[str, int]]:
    """Per ZeRO stage 1-3 on pp2 x dp2: the autograd drivers built and the hooks of the
    kinds they install, counted while ``parallelize`` builds the model and one step runs
    (stage 1 under pp keeps autograd's driver: the control that the counting sees it)."""
    from plait.parallel.zero.driver import AutogradDriver

    mesh = ctx.mesh(dp=2, pp=2)
    out: dict[int, dict[str, int]] = {}
    for zero in (1, 2, 3):
        par = ParallelConfig(dp=2, pp=2, zero=zero, pipeline_schedule="1f1b", microbatches=2)
        train = TrainConfig(global_batch=BATCH, seq_len=SEQ)
        cfg = Config(model=model_config(LAYERS, tied=False), parallel=par, train=train)
        model = Transformer(cfg.model, seed=3).double()
        with (
            _spy(AutogradDriver, "__init__") as init,
            _spy(torch.Tensor, "register_post_accumulate_grad_hook") as grad,
            _spy(nn.Module, "register_forward_hook") as post,
        ):
            pm = parallelize(model, mesh, cfg)
            x, y = batches()[0]
            per, r = BATCH // 2, mesh.index("dp")
            pm.step(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])
        assert pm.zero is not None and pm.pipeline is not None
        out[zero] = {
            "drivers": init.call_count,
            "grad_hooks": grad.call_count,
            "forward_hooks": post.call_count,
            "autograd": int(pm.zero.driver is not None),
            "schedule": int(pm.pipeline.zero is not None),
            "params": sum(1 for _ in pm.zero.module.parameters()),
        }
    return out


def test_the_schedule_driven_zero_never_installs_the_autograd_driver(
    pools: Callable[[int], WorkerPool],
) -> None:
    """pp2 x dp2, ZeRO-2 and ZeRO-3 through ``parallelize`` and one step: no
    :class:`~plait.parallel.zero.driver.AutogradDriver` is built and no post-accumulate-grad
    or forward hook is registered (not even installed and removed again); ZeRO-1, which
    autograd drives under pp, shows the counting sees them."""
    for r in pools(4).run(f"{M}:_body_hooks"):
        control = r[1]
        assert control["drivers"] == control["autograd"] == 1 and control["schedule"] == 0
        assert control["grad_hooks"] == control["params"] > 0
        for zero in (2, 3):
            assert r[zero]["schedule"] == 1 and r[zero]["autograd"] == 0
            assert r[zero]["drivers"] == r[zero]["grad_hooks"] == r[zero]["forward_hooks"] == 0


def test_cli_pp2_dp2_tp2_zero3_matches_one_process(tmp_path: Path) -> None:
    """`plait train --nproc 8 --pp 2 --dp 2 --tp 2 --zero 3` end to end (1F1B, 4
    micro-batches, each piece re-gathered per micro-batch): the losses and clipping norms
    of one process (fp32, rtol 1e-5)."""
    from plait.cli import main
    from tests.tiny import read_metrics, run_plait, tiny_args

    one, eight = tmp_path / "one.jsonl", tmp_path / "eight.jsonl"
    tiny = [*tiny_args(), "--steps", "3"]
    assert main(["train", *tiny, "--nproc", "1", "--metrics", str(one)]) == 0
    layout = ["--nproc", "8", "--pp", "2", "--dp", "2", "--tp", "2", "--zero", "3"]
    layout += ["--parallel.pp_reshard", "true", "--metrics", str(eight)]
    r = run_plait(["train", *tiny, *layout], tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ZeRO stage 3 over dp" in r.stdout
    assert "parameters re-gathered for every action" in r.stdout
    want, got = read_metrics(one), read_metrics(eight)
    assert len(got) == len(want) == 3
    for key in ("loss", "grad_norm"):
        assert [x[key] for x in got] == pytest.approx([x[key] for x in want], rel=1e-5)
