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
from plait.parallel.pipeline.actions import Action, Op
from plait.parallel.pipeline.runtime import PipelineRuntime, pipeline_step
from plait.parallel.pipeline.schedules import build_schedule
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


def batches(steps: int = STEPS, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(steps)
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


CASES = [("naive", 1, 1), ("gpipe", MICRO, 1), ("1f1b", MICRO, 1), ("interleaved", MICRO, 2)]
CASES += [("zb", MICRO, 1)]
"""(schedule, micro-batches, chunks per rank); interleaved at pp 4 x 2 chunks uses all 8
blocks, one per piece."""


def _body_pipeline(
    ctx: WorkerContext,
    name: str,
    m: int,
    v: int,
    tied: bool = False,
    boundaries: list[int] | None = None,
    placement: str = "adjacent",
    early_recv: bool = True,
) -> dict[str, object]:
    p = ctx.world_size
    mesh = ctx.mesh(dp=1, pp=p)
    model = Transformer(model_config(tied=tied), seed=3).double()
    stages = split_transformer(model, mesh, chunks=v, boundaries=boundaries)
    schedule = build_schedule(name, p, m, v, placement=placement)
    runtime = PipelineRuntime(
        stages,
        schedule,
        mesh.axis("pp"),
        loss64,
        (BATCH // m, SEQ, 16),
        torch.float64,
        early_recv=early_recv,
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


@pytest.mark.parametrize(("name", "m", "v"), CASES)
@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_matches_one_process(
    pools: Callable[[int], WorkerPool],
    refs: dict[bool, dict[str, object]],
    name: str,
    m: int,
    v: int,
    p: int,
) -> None:
    check_parity(pools(p).run(f"{M}:_body_pipeline", name, m, v), refs[False])


@pytest.mark.parametrize(("name", "m", "v"), [("interleaved", MICRO, 2), ("zb", MICRO, 1)])
def test_lockstep_placement_matches_one_process(
    pools: Callable[[int], WorkerPool],
    refs: dict[bool, dict[str, object]],
    name: str,
    m: int,
    v: int,
) -> None:
    """The comm placement for rendezvous (NCCL-like) sends runs the same math."""
    results = pools(4).run(f"{M}:_body_pipeline", name, m, v, False, None, "lockstep")
    check_parity(results, refs[False])


@pytest.mark.parametrize(("name", "m", "v"), [("1f1b", MICRO, 1), ("interleaved", MICRO, 2)])
def test_receives_in_their_own_batch_match_one_process(
    pools: Callable[[int], WorkerPool],
    refs: dict[bool, dict[str, object]],
    name: str,
    m: int,
    v: int,
) -> None:
    """``early_recv=False`` (each receive posted with its own batch) runs the same math."""
    results = pools(2).run(f"{M}:_body_pipeline", name, m, v, False, None, "adjacent", False)
    check_parity(results, refs[False])


def _body_posts(ctx: WorkerContext, name: str, v: int, early: bool) -> list[list[str]]:
    """One step; per batched isend/irecv call, the receives it posts (``kind:tag``)."""
    from plait import comm

    mesh = ctx.mesh(dp=1, pp=ctx.world_size)
    stages = split_transformer(Transformer(model_config(), seed=3).double(), mesh, chunks=v)
    schedule = build_schedule(name, ctx.world_size, MICRO, v)
    runtime = PipelineRuntime(
        stages, schedule, mesh.axis("pp"), loss64, (BATCH // MICRO, SEQ, 16), torch.float64,
        early_recv=early,
    )
    calls: list[list[str]] = []
    real = comm.batch_isend_irecv

    def spy(ops: list[comm.P2P], g: comm.AxisGroup) -> list[comm.Handle]:
        calls.append([f"recv:{o.tag}" for o in ops if o.kind == "recv"])
        return real(ops, g)

    comm.batch_isend_irecv = spy
    try:
        x, y = batches()[0]
        runtime.step(x, y)
    finally:
        comm.batch_isend_irecv = real
    return calls


@pytest.mark.parametrize("early", [True, False])
def test_early_receives_are_posted_one_batch_ahead(
    pools: Callable[[int], WorkerPool], early: bool
) -> None:
    """With ``early_recv`` every communication batch also posts the next batch's
    receives (the first posts its own too); without it each posts only its own."""
    from plait.parallel.pipeline.runtime import _ACT, _GRAD, _comm_batches, _tag

    schedule = build_schedule("interleaved", 2, MICRO, 2)
    results = pools(2).run(f"{M}:_body_posts", "interleaved", 2, early)
    for rank, calls in enumerate(results):
        acts = schedule.actions[rank]
        runs = [acts[i:j] for i, (j, _) in sorted(_comm_batches(acts).items())]
        assert len(calls) == len(runs)

        def recvs(run: tuple[Action, ...]) -> list[str]:
            out = []
            for a in run:
                if a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                    kind = _ACT if a.op is Op.RECV_ACT else _GRAD
                    out.append(f"recv:{_tag(kind, a.microbatch, a.stage, MICRO, 4)}")
            return out

        if early:
            want = [recvs(runs[0]) + recvs(runs[1])]
            want += [recvs(runs[k + 1]) if k + 1 < len(runs) else [] for k in range(1, len(runs))]
        else:
            want = [recvs(run) for run in runs]
        assert calls == want
        assert any(len(c) > 0 for c in calls)


def test_tied_embeddings_across_first_and_last_stage(
    pools: Callable[[int], WorkerPool], refs: dict[bool, dict[str, object]]
) -> None:
    results = pools(4).run(f"{M}:_body_pipeline", "interleaved", MICRO, 2, True)
    check_parity(results, refs[True])
    # both copies of the tied matrix stayed equal to the one-device matrix
    first = results[0]["weights"]["tok_embeddings.weight"]  # type: ignore[index]
    last = results[3]["weights"]["output.weight"]  # type: ignore[index]
    assert torch.equal(first, last)


def test_records_cover_every_action(pools: Callable[[int], WorkerPool]) -> None:
    results = pools(2).run(f"{M}:_body_pipeline", "zb", MICRO, 1)
    sched = build_schedule("zb", 2, MICRO)
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
            build_schedule("gpipe", 4, 4),
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


def _one_rank_runtime(m: int, batch: int = BATCH) -> tuple[PipelineRuntime, object]:
    from plait import init_mesh

    mesh = init_mesh()  # no process group: pp = 1, the degenerate pipeline
    model = Transformer(model_config(), seed=3).double()
    stages = split_transformer(model, mesh, chunks=1)
    rt = PipelineRuntime(
        stages,
        build_schedule("gpipe", 1, m),
        mesh.axis("pp"),
        loss64,
        (batch // m, SEQ, 16),
        torch.float64,
    )
    return rt, stages


def test_one_rank_pipeline_is_gradient_accumulation(refs: dict[bool, dict[str, object]]) -> None:
    """p = 1 (no communication): m micro-batches accumulate the whole batch's gradient."""
    rt, stages = _one_rank_runtime(MICRO)
    opt = torch.optim.AdamW(stages.parameters(), lr=1e-2, weight_decay=0.1)  # type: ignore[attr-defined]
    losses = []
    for x, y in batches():
        losses.append(pipeline_step(stages, rt, x, y))  # type: ignore[arg-type]
        opt.step()
        opt.zero_grad(set_to_none=True)
    weights = {k: v for p in stages.chunks for k, v in p.state_dict().items()}  # type: ignore[attr-defined]
    check_parity([{"losses": losses, "weights": weights}], refs[False])


def test_batch_that_does_not_split_is_refused() -> None:
    rt, _ = _one_rank_runtime(MICRO)
    x = torch.zeros(6, SEQ, dtype=torch.long)
    with pytest.raises(
        ConfigError, match="a batch of 6 sequences does not split into 4 micro-batches of 2"
    ):
        rt.step(x, x)


def _body_p2p_bytes(ctx: WorkerContext, name: str, m: int, v: int) -> dict[str, float]:
    p = ctx.world_size
    mesh = ctx.mesh(dp=1, pp=p)
    stages = split_transformer(Transformer(model_config(), seed=3).double(), mesh, chunks=v)
    runtime = PipelineRuntime(
        stages, build_schedule(name, p, m, v), mesh.axis("pp"), loss64, (BATCH // m, SEQ, 16),
        torch.float64,
    )
    x, y = batches()[0]
    mesh.stats.reset()
    runtime.step(x, y)
    return {op: mesh.stats.get("pp", op).bytes for op in ("send", "recv")}


@pytest.mark.parametrize(("name", "m", "v"), [("1f1b", MICRO, 1), ("interleaved", MICRO, 2)])
def test_p2p_bytes_match_the_boundary_formula(
    pools: Callable[[int], WorkerPool], name: str, m: int, v: int
) -> None:
    """Bytes sent over pp in one step, summed over ranks, from the comm counters: each of
    the p·v - 1 piece boundaries carries m activations forward and m gradients back, each
    (BATCH/m, SEQ, dim) float64; every byte sent is received once."""
    p = 4
    results = pools(p).run(f"{M}:_body_p2p_bytes", name, m, v)
    want = (p * v - 1) * m * 2 * (BATCH // m) * SEQ * 16 * 8
    assert sum(r["send"] for r in results) == want
    assert sum(r["recv"] for r in results) == want


def _body_eval(ctx: WorkerContext, name: str, m: int, v: int) -> list[float]:
    p = ctx.world_size
    mesh = ctx.mesh(dp=1, pp=p)
    stages = split_transformer(Transformer(model_config(), seed=3).double(), mesh, chunks=v)
    runtime = PipelineRuntime(
        stages, build_schedule(name, p, m, v), mesh.axis("pp"), loss64, (BATCH // m, SEQ, 16),
        torch.float64,
    )
    with torch.no_grad():
        return [runtime.loss_to_all(runtime.forward_loss(x, y)) for x, y in batches()]


@pytest.mark.parametrize(("name", "m", "v"), [("1f1b", MICRO, 1), ("interleaved", MICRO, 2)])
def test_forward_only_evaluation_matches_one_process(
    pools: Callable[[int], WorkerPool], name: str, m: int, v: int
) -> None:
    """``PipelineEngine.evaluate``'s path (forward actions, loss broadcast from the last
    stage): every rank gets the one-process loss of each batch (float64, rtol 1e-9)."""
    model = Transformer(model_config(), seed=3).double()
    with torch.no_grad():
        want = [loss64(model(x), y).item() for x, y in batches()]
    for got in pools(4).run(f"{M}:_body_eval", name, m, v):
        assert got == pytest.approx(want, rel=RTOL)
