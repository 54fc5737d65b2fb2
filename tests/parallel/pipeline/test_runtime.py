"""Pipeline runtime: parity with one process for every schedule at pp 2 and pp 4.

Parity protocol: the built-in transformer is built from one seed in float64; the
reference trains it for STEPS AdamW steps in the pytest process on the whole global
batch; every pipeline rank builds the same full model, keeps its pieces
(``split_transformer``), runs the schedule on the same batch cut into M micro-batches,
and steps AdamW on its own parameters. Compared: the loss at every step (the runtime's
mean over micro-batches, broadcast from the last stage) and every weight after the last
step, by the one-device parameter name. Tolerance: float64, rtol=1e-9 / atol=1e-11 (the
only difference is summation order: micro-batch gradients are summed one by one).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from plait.config import ModelConfig
from plait.errors import ConfigError
from plait.model import Transformer, lm_loss
from plait.parallel.pipeline.actions import Action, Op, Schedule
from plait.parallel.pipeline.runtime import PipelineRuntime, pipeline_step
from plait.parallel.pipeline.split import split_transformer
from plait.testing import WorkerContext, WorkerPool

M = "tests.parallel.pipeline.test_runtime"
STEPS = 3
BATCH = 8
SEQ = 8
VOCAB = 32
MICRO = 4
RTOL, ATOL = 1e-9, 1e-11


def model_config(layers: int = 8, tied: bool = False) -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB,
        dim=16,
        n_layers=layers,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=SEQ,
        tie_embeddings=tied,
    )


def loss64(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in the logits' dtype (``lm_loss`` computes in float32)."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def reference(tied: bool = False) -> dict[str, object]:
    """One process, whole batch, float64."""
    model = Transformer(model_config(tied=tied), seed=3).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in batches():
        loss = loss64(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach() for k, v in model.state_dict().items()}}


def hand_schedule(name: str, p: int, m: int) -> Schedule:
    """GPipe or 1F1B written out by hand (independent of schedules.py)."""
    acts: list[tuple[Action, ...]] = []
    for r in range(p):
        fwd = [
            [
                *([Action(Op.RECV_ACT, i, r)] if r > 0 else []),
                Action(Op.FORWARD, i, r),
                *([Action(Op.SEND_ACT, i, r)] if r < p - 1 else []),
            ]
            for i in range(m)
        ]
        bwd = [
            [
                *([Action(Op.RECV_GRAD, i, r)] if r < p - 1 else []),
                Action(Op.BACKWARD, i, r),
                *([Action(Op.SEND_GRAD, i, r)] if r > 0 else []),
            ]
            for i in range(m)
        ]
        if name == "gpipe":
            order = fwd + bwd
        else:  # 1f1b: warm-up p-1-r forwards, then alternate, then drain
            warm = min(p - 1 - r, m)
            order = fwd[:warm]
            for i in range(m - warm):
                order += [fwd[warm + i], bwd[i]]
            order += bwd[m - warm :]
        acts.append(tuple(a for group in order for a in group))
    return Schedule(name, p, m, 1, tuple(acts))


def get_schedule(name: str, p: int, m: int, v: int) -> Schedule:
    if name.startswith("hand-"):
        return hand_schedule(name[5:], p, m)
    from plait.parallel.pipeline.schedules import build_schedule

    return build_schedule(name, p, m, v)


def _body_pipeline(
    ctx: WorkerContext, name: str, m: int, v: int, tied: bool = False
) -> dict[str, object]:
    p = ctx.world_size
    mesh = ctx.mesh(dp=1, pp=p)
    model = Transformer(model_config(tied=tied), seed=3).double()
    stages = split_transformer(model, mesh, chunks=v)
    schedule = get_schedule(name, p, m, v)
    runtime = PipelineRuntime(
        stages, schedule, mesh.axis("pp"), loss64, (BATCH // m, SEQ, 16), torch.float64
    )
    opt = torch.optim.AdamW(stages.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in batches():
        losses.append(pipeline_step(stages, runtime, x, y))
        opt.step()
        opt.zero_grad(set_to_none=True)
    weights = {k: v for piece in stages.chunks for k, v in piece.state_dict().items()}
    records = [r.as_tuple() for r in runtime.records]
    return {"losses": losses, "weights": weights, "records": records}


@pytest.fixture(scope="module")
def refs() -> dict[bool, dict[str, object]]:
    return {False: reference(False), True: reference(True)}


def check_parity(results: list[dict[str, object]], ref: dict[str, object]) -> None:
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=RTOL)
    seen: set[str] = set()
    for r in results:
        for k, w in r["weights"].items():  # type: ignore[attr-defined]
            torch.testing.assert_close(w, ref["weights"][k], rtol=RTOL, atol=ATOL)  # type: ignore[index]
            seen.add(k)
    assert seen == set(ref["weights"])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["hand-gpipe", "hand-1f1b"])
@pytest.mark.parametrize("p", [2, 4])
def test_hand_schedules_match_one_process(
    pools: Callable[[int], WorkerPool], refs: dict[bool, dict[str, object]], name: str, p: int
) -> None:
    check_parity(pools(p).run(f"{M}:_body_pipeline", name, MICRO, 1), refs[False])


def test_tied_embeddings_across_first_and_last_stage(
    pools: Callable[[int], WorkerPool], refs: dict[bool, dict[str, object]]
) -> None:
    results = pools(4).run(f"{M}:_body_pipeline", "hand-1f1b", MICRO, 1, True)
    check_parity(results, refs[True])
    # both copies of the tied matrix stayed equal to the one-device matrix
    first = results[0]["weights"]["tok_embeddings.weight"]  # type: ignore[index]
    last = results[3]["weights"]["output.weight"]  # type: ignore[index]
    assert torch.equal(first, last)


def test_records_cover_every_action(pools: Callable[[int], WorkerPool]) -> None:
    results = pools(2).run(f"{M}:_body_pipeline", "hand-1f1b", MICRO, 1)
    sched = hand_schedule("1f1b", 2, MICRO)
    for rank, r in enumerate(results):
        recs = r["records"]
        assert [a for _, a, _, _ in recs] == list(sched.actions[rank])
        assert all(rk == rank and 0 <= s <= e for rk, _, s, e in recs)
        ends = [e for *_, e in recs]
        assert ends == sorted(ends)


def _body_wrong_layout(ctx: WorkerContext) -> str:
    mesh = ctx.mesh(dp=1, pp=2)
    stages = split_transformer(Transformer(model_config(), seed=3), mesh)
    try:
        PipelineRuntime(
            stages,
            hand_schedule("gpipe", 4, 4),
            mesh.axis("pp"),
            lm_loss,
            (2, SEQ, 16),
            torch.float32,
        )
    except ConfigError as e:
        return str(e)
    return "accepted"


def test_runtime_refuses_a_schedule_for_another_layout(pools: Callable[[int], WorkerPool]) -> None:
    for msg in pools(2).run(f"{M}:_body_wrong_layout"):
        assert "for 4 ranks x 1 chunks" in msg and "pipeline has 2 ranks and 2 pieces" in msg
