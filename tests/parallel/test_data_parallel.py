"""Data parallelism: parity with one process, accumulation, overlap, unused parameters.

Parity protocol: the model is built from one seed, run in float64 for STEPS AdamW steps
on one process over the whole global batch (in the pytest process: a one-rank mesh,
the same code path), and under dp=N where each rank takes its contiguous slice of the
same global batch. Tolerance: float64, rtol=1e-9 / atol=1e-10 on losses, gradients after
step 1 and weights after the last step (the only difference is summation order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import nn

from plait import init_mesh
from plait.errors import UnusedParametersError
from plait.mesh import Mesh
from plait.parallel.data_parallel import DataParallel
from plait.testing import WorkerContext, WorkerPool
from plait.train.memory import memory_report

M = "tests.parallel.test_data_parallel"
STEPS = 5
GLOBAL_BATCH = 8
SEQ = 12
VOCAB = 32
RTOL, ATOL = 1e-9, 1e-10


class EncoderLM(nn.Module):
    """A model not written in plait: torch's TransformerEncoder with an embedding and head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)))  # (batch, seq, vocab)


class MLP(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, VOCAB)
        self.spare = nn.Linear(4, 4) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.emb(x))))


def _builtin() -> nn.Module:
    from plait.config import ModelConfig
    from plait.model import Transformer

    cfg = ModelConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ
    )
    return Transformer(cfg)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP,
    "encoder": EncoderLM,
    "builtin": _builtin,
    "mlp_unused": lambda: MLP(unused=True),
}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        out.append((x, y))
    return out


def _train(
    mesh: Mesh, model_name: str, accum: int = 1, bucket_mb: float = 0.01
) -> dict[str, object]:
    torch.manual_seed(0)
    model = MODELS[model_name]().double()
    dp = DataParallel(model, mesh, bucket_mb=bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    n, r = mesh.size("dp"), mesh.index("dp")
    per_rank = GLOBAL_BATCH // n
    micro = per_rank // accum
    losses, grads1 = [], {}
    for step, (x, y) in enumerate(_batches()):
        xs, ys = x[r * per_rank : (r + 1) * per_rank], y[r * per_rank : (r + 1) * per_rank]
        total = torch.zeros((), dtype=torch.float64)
        for k in range(accum):
            sl = slice(k * micro, (k + 1) * micro)
            ctx = dp.no_sync() if k < accum - 1 else contextlib.nullcontext()
            with ctx:
                logits = dp(xs[sl])
                loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ys[sl].reshape(-1))
                (loss / accum).backward()
            total += loss.detach() / accum
        losses.append(total.item())  # this rank's mean loss; the test averages over ranks
        if step == 0:
            grads1 = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    weights = {k: p.detach().clone() for k, p in model.named_parameters()}
    return {
        "losses": losses,
        "grads1": grads1,
        "weights": weights,
        "bytes": mesh.stats.total_bytes("dp"),
    }


def _body_train(ctx: WorkerContext, dp: int, model_name: str, accum: int) -> dict[str, object]:
    return _train(ctx.mesh(dp=dp), model_name, accum)


class _References(dict):  # type: ignore[type-arg]
    """One-process runs, computed on first use and shared by the module's tests."""

    def __missing__(self, name: str) -> dict[str, object]:
        self[name] = _train(init_mesh(), name)
        return self[name]


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, object]]:
    return _References()


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    ("world", "model_name", "accum"),
    [(2, "builtin", 1), (4, "builtin", 1), (2, "encoder", 1), (4, "mlp", 1), (2, "builtin", 2)],
)
def test_parity_with_one_process(
    pools: Callable[[int], WorkerPool],
    reference: dict[str, dict[str, object]],
    world: int,
    model_name: str,
    accum: int,
) -> None:
    ref = reference[model_name]
    results = pools(world).run(f"{M}:_body_train", world, model_name, accum)
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in results) / world
        assert mean == pytest.approx(ref["losses"][step], rel=RTOL)  # type: ignore[index]
    for r in results:
        for k, g in ref["grads1"].items():  # type: ignore[attr-defined]
            _close(r["grads1"][k], g)
        for k, w in ref["weights"].items():  # type: ignore[attr-defined]
            _close(r["weights"][k], w)
    # replicas stay bit-identical
    for r in results[1:]:
        for k, w in results[0]["weights"].items():
            assert torch.equal(r["weights"][k], w)


def _body_traffic(ctx: WorkerContext) -> tuple[float, int, int, int]:
    mesh = ctx.mesh(dp=ctx.world_size)
    torch.manual_seed(0)
    model = MLP()
    dp = DataParallel(model, mesh, bucket_mb=0.002)
    x = torch.randint(0, VOCAB, (4, SEQ))
    mesh.stats.reset()
    for k in range(3):  # accumulation: only the last micro-step communicates
        with dp.no_sync() if k < 2 else contextlib.nullcontext():
            dp(x).sum().backward()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    s = mesh.stats.get("dp", "all_reduce")
    return s.bytes, s.calls, nbytes, len(dp.buckets)


@pytest.mark.parametrize("world", [2, 4])
def test_traffic_matches_ring_formula(pools: Callable[[int], WorkerPool], world: int) -> None:
    for got, calls, nbytes, nbuckets in pools(world).run(f"{M}:_body_traffic"):
        assert nbuckets > 1
        assert calls == nbuckets  # one all-reduce per bucket, none in no_sync steps
        assert got == pytest.approx(2 * (world - 1) / world * nbytes, rel=1e-12)


def _body_events(ctx: WorkerContext) -> list[tuple[str, object]]:
    mesh = ctx.mesh(dp=ctx.world_size)
    torch.manual_seed(0)
    dp = DataParallel(_builtin(), mesh, bucket_mb=0.01, record_events=True)
    x = torch.randint(0, VOCAB, (2, SEQ))
    dp(x).float().pow(2).mean().backward()
    return dp.events


def test_first_bucket_launches_before_backward_finishes(
    pools: Callable[[int], WorkerPool],
) -> None:
    for events in pools(2).run(f"{M}:_body_events"):
        kinds = [k for k, _ in events]
        first_launch = kinds.index("launch")
        last_grad = len(kinds) - 1 - kinds[::-1].index("grad")
        assert first_launch < last_grad, events  # communication overlapped backward
        assert kinds.count("launch") > 1
        assert kinds[-2:] == ["backward_end", "synced"]


def _grad_storage_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages behind the parameters' ``.grad`` tensors."""
    storages = {
        p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
        for p in model.parameters()
        if p.grad is not None
    }
    return sum(storages.values())


def _body_grad_bytes(ctx: WorkerContext) -> dict[str, object]:
    mesh = ctx.mesh(dp=ctx.world_size)
    torch.manual_seed(0)
    model = _builtin()
    dp = DataParallel(model, mesh, bucket_mb=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, VOCAB, (2, SEQ))
    out: dict[str, object] = {"param_bytes": sum(p.nbytes for p in model.parameters())}
    for step, zero in enumerate([True, False, True]):  # fresh grads, then in-place zeroing
        with dp.no_sync():  # accumulation: the views, or fresh tensors moved in later
            dp(x).float().pow(2).mean().backward()
        dp(x).float().pow(2).mean().backward()
        buckets = {b.buffer.untyped_storage().data_ptr() for b in dp.buckets}
        out[f"grad_bytes_{step}"] = _grad_storage_bytes(model)
        out[f"views_{step}"] = all(
            p.grad is not None and p.grad.untyped_storage().data_ptr() in buckets
            for p in model.parameters()
        )
        out[f"report_{step}"] = memory_report(dp).bytes["grads"]
        opt.step()
        dp.zero_grad(set_to_none=zero)
    return out


def test_gradients_are_views_into_the_buckets(pools: Callable[[int], WorkerPool]) -> None:
    """One copy of the gradients per rank: every ``.grad`` is a view into its bucket and
    the distinct storages behind them hold exactly the parameters' bytes (measured from
    the tensors), after accumulation, after ``zero_grad(set_to_none=True)`` (fresh
    gradients moved into the buckets) and after zeroing in place."""
    for r in pools(2).run(f"{M}:_body_grad_bytes"):
        for step in range(3):
            assert r[f"views_{step}"]
            assert r[f"grad_bytes_{step}"] == r["param_bytes"]
            assert r[f"report_{step}"] == r["param_bytes"]  # memory_report counts the same


def _body_unused(ctx: WorkerContext, find: bool) -> str:
    mesh = ctx.mesh(dp=ctx.world_size)
    model = MLP(unused=True)
    dp = DataParallel(model, mesh, find_unused_parameters=find)
    x = torch.randint(0, VOCAB, (2, SEQ))
    try:
        dp(x).sum().backward()
    except UnusedParametersError as e:
        return str(e)
    assert model.spare is not None and model.spare.weight.grad is not None
    return "zeros" if torch.all(model.spare.weight.grad == 0) else "nonzero"


def test_unused_parameters_refused_by_name_or_zeroed(pools: Callable[[int], WorkerPool]) -> None:
    msgs = pools(2).run(f"{M}:_body_unused", False)
    for m in msgs:
        assert "spare.weight" in m and "spare.bias" in m and "find_unused_parameters" in m
    assert pools(2).run(f"{M}:_body_unused", True) == ["zeros", "zeros"]


def _body_broadcast(ctx: WorkerContext) -> list[float]:
    mesh = ctx.mesh(dp=ctx.world_size)
    torch.manual_seed(ctx.rank)  # deliberately different initial weights per rank
    model = MLP()
    DataParallel(model, mesh)
    return [p.sum().item() for p in model.parameters()]


def test_initial_weights_broadcast_from_rank0(pools: Callable[[int], WorkerPool]) -> None:
    res = pools(4).run(f"{M}:_body_broadcast")
    assert all(r == res[0] for r in res)
    torch.manual_seed(0)
    assert res[0] == [p.sum().item() for p in MLP().parameters()]
