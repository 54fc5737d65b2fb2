"""Tensor-parallel layers against their one-device twins, the plan, and bad input.

Every layer is built from a seeded one-device module (nn.Linear, nn.Embedding) and fed
seeded inputs and upstream gradients, in float64; the twin's forward and backward run in
the pytest process on the same tensors. Outputs, input gradients and weight gradients
(gathered back with the shard metadata) must match to rtol=1e-12 / atol=1e-12 (only the
summation order differs). The vocabulary of 37 is padded at tp 2 and 4; the padded
logits are filled with +50 before the loss so a missing mask would change it.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait import init_mesh
from plait.config import ModelConfig
from plait.errors import ConfigError
from plait.model import Transformer
from plait.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_info,
)
from plait.parallel.tensor.loss import vocab_parallel_cross_entropy
from plait.parallel.tensor.sharding_plan import (
    TRANSFORMER_TP_PLAN,
    apply_tensor_parallel,
    check_tensor_parallel,
    gather_full_state,
    load_full_state,
    resolve_sharding_plan,
)
from plait.testing import WorkerContext, WorkerPool

M = "tests.parallel.tensor.test_layers"
Pools = Callable[[int], WorkerPool]
B, S, V, IGN = 2, 8, 37, -100
TOL = {"rtol": 1e-12, "atol": 1e-12}
f64 = torch.float64


def _data(case: str) -> dict[str, object]:
    """The seeded module and tensors of one case (identical in the ranks and in pytest)."""
    seed = zlib.crc32(case.encode())
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if case.startswith("column"):
        mod: nn.Module = nn.Linear(16, 12, bias=True, dtype=f64)
        x, up = (
            torch.randn(B, S, 16, generator=g, dtype=f64),
            torch.randn(B, S, 12, generator=g, dtype=f64),
        )
    elif case.startswith("row"):
        mod = nn.Linear(12, 10, bias=True, dtype=f64)
        x, up = (
            torch.randn(B, S, 12, generator=g, dtype=f64),
            torch.randn(B, S, 10, generator=g, dtype=f64),
        )
    elif case.startswith("embedding"):
        mod = nn.Embedding(V, 8, dtype=f64)
        x = torch.arange(B * S).reshape(B, S) * 5 % V  # every shard's range is hit
        up = torch.randn(B, S, 8, generator=g, dtype=f64)
    else:  # cross-entropy
        mod = nn.Identity()
        dtype = torch.float32 if case == "ce_fp32" else f64
        x = torch.randn(B, S, V, generator=g, dtype=dtype) * 3
        up = torch.randint(0, V, (B, S), generator=g)
        up[0, :3] = IGN
        up[1, -1] = V - 1  # the last real column, next to the padding
    return {"mod": mod, "x": x, "up": up}


def _rows(t: torch.Tensor, r: int, n: int, dim: int) -> torch.Tensor:
    k = t.shape[dim] // n
    return t.narrow(dim, r * k, k)


def _grads(mod: nn.Module, g: object) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in mod.named_parameters():
        info = shard_info(p)
        assert p.grad is not None and info is not None
        out[name] = info.gather(p.grad, g)  # type: ignore[arg-type]
    return out


def _body_layer(ctx: WorkerContext, case: str) -> dict[str, object]:
    mesh = ctx.mesh(tp=ctx.world_size)
    g = mesh.axis("tp")
    r, n = g.index, g.size
    d = _data(case)
    mod, x, up = d["mod"], d["x"], d["up"]
    assert isinstance(mod, nn.Module) and isinstance(x, torch.Tensor)
    assert isinstance(up, torch.Tensor)
    if case.startswith("ce"):
        vp = -(-V // n) * n
        padded = torch.cat([x, x.new_full((B, S, vp - V), 50.0)], dim=-1)
        local = _rows(padded, r, n, -1).clone().requires_grad_(True)
        red = "sum" if case == "ce_sum" else "mean"
        loss = vocab_parallel_cross_entropy(local, up, g, V, IGN, reduction=red)
        loss.backward()
        return {"y": loss.detach(), "dx": local.grad, "grads": {}}
    sp = case.endswith("_sp")
    if case.startswith("column"):
        layer: nn.Module = ColumnParallelLinear(mod, g, gather_output=not sp, sequence_parallel=sp)  # type: ignore[arg-type]
        xin = _rows(x, r, n, 1) if sp else x
        upl = _rows(up, r, n, -1) if sp else up
    elif case.startswith("row"):
        layer = RowParallelLinear(mod, g, input_is_parallel=sp, sequence_parallel=sp)  # type: ignore[arg-type]
        xin = _rows(x, r, n, -1) if sp else x
        upl = _rows(up, r, n, 1) if sp else up
    else:
        layer = VocabParallelEmbedding(mod, g, sequence_parallel=sp)  # type: ignore[arg-type]
        xin, upl = x, (_rows(up, r, n, 1) if sp else up)
    xin = xin.clone().requires_grad_(xin.is_floating_point())
    y = layer(xin)
    y.backward(upl)
    return {"y": y.detach(), "dx": xin.grad, "grads": _grads(layer, g)}


def _reference(case: str, r: int, n: int) -> dict[str, object]:
    d = _data(case)
    mod, x, up = d["mod"], d["x"], d["up"]
    assert isinstance(mod, nn.Module) and isinstance(x, torch.Tensor)
    assert isinstance(up, torch.Tensor)
    if case.startswith("ce"):
        full = x.clone().requires_grad_(True)
        red = "sum" if case == "ce_sum" else "mean"
        loss = F.cross_entropy(full.reshape(-1, V), up.reshape(-1), ignore_index=IGN, reduction=red)
        loss.backward()
        assert full.grad is not None
        vp = -(-V // n) * n
        gpad = torch.cat([full.grad, full.grad.new_zeros(B, S, vp - V)], dim=-1)
        return {"y": loss.detach(), "dx": _rows(gpad, r, n, -1), "grads": {}}
    sp = case.endswith("_sp")
    xin = x.clone().requires_grad_(x.is_floating_point())
    y = mod(xin)
    y.backward(up)
    grads = {k: p.grad for k, p in mod.named_parameters()}
    if case.startswith("column"):
        y_r = _rows(y, r, n, -1) if sp else y
        dx = _rows(xin.grad, r, n, 1) if sp else xin.grad  # type: ignore[arg-type]
    elif case.startswith("row"):
        y_r = _rows(y, r, n, 1) if sp else y
        dx = _rows(xin.grad, r, n, -1) if sp else xin.grad  # type: ignore[arg-type]
    else:
        y_r, dx = (_rows(y, r, n, 1) if sp else y), None
    return {"y": y_r.detach(), "dx": dx, "grads": grads}


CASES = [
    "column",
    "column_sp",
    "row",
    "row_sp",
    "embedding",
    "embedding_sp",
    "ce",
    "ce_sum",
    "ce_fp32",
]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_layer_matches_one_device_twin(pools: Pools, tp: int, case: str) -> None:
    results = pools(tp).run(f"{M}:_body_layer", case)
    tol = {"rtol": 1e-5, "atol": 1e-6} if case == "ce_fp32" else TOL
    for r, got in enumerate(results):
        want = _reference(case, r, tp)
        torch.testing.assert_close(got["y"], want["y"], **tol)
        if want["dx"] is None:
            assert got["dx"] is None
        else:
            torch.testing.assert_close(got["dx"], want["dx"], **tol)
        assert set(got["grads"]) == set(want["grads"])
        for k, gw in want["grads"].items():
            torch.testing.assert_close(got["grads"][k], gw, **tol)


# ---------------------------------------------------------------- the plan and bad input


def _cfg(**kw: object) -> ModelConfig:
    base: dict[str, object] = {
        "vocab_size": V,
        "dim": 32,
        "n_layers": 1,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_dim": 64,
        "max_seq_len": 16,
    }
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "tp", "sp", "seq", "needles"),
    [
        ({"n_heads": 4, "n_kv_heads": 4}, 3, False, None, ["n_heads: 4 heads", "[1, 2, 4]"]),
        ({"dim": 48, "n_heads": 6, "n_kv_heads": 3}, 2, False, None, ["3 key/value heads", "tp=2"]),
        (
            {"dim": 64, "n_heads": 8, "ffn_dim": 100},
            8,
            False,
            None,
            ["ffn_dim: 100 features", "tp=8", "[1, 2, 4, 5, 10"],
        ),
        ({}, 4, True, 10, ["sequence length 10", "multiple of 4"]),
    ],
)
def test_config_check_names_the_numbers(
    kw: dict[str, object], tp: int, sp: bool, seq: int | None, needles: list[str]
) -> None:
    with pytest.raises(ConfigError) as e:
        check_tensor_parallel(_cfg(**kw), tp, sp, seq)
    for s in needles:
        assert s in str(e.value)


def test_config_check_accepts_replicated_kv_heads() -> None:
    check_tensor_parallel(_cfg(n_heads=8, n_kv_heads=2, dim=64), 4, True, 16)  # kv 2 < tp 4
    check_tensor_parallel(_cfg(n_heads=8, n_kv_heads=1, dim=64), 8)


def test_plan_must_cover_the_model() -> None:
    model = Transformer(_cfg(), seed=0)
    with pytest.raises(ConfigError, match="matches no module"):
        resolve_sharding_plan(model, [*TRANSFORMER_TP_PLAN, ("layers.*.mlp", "colwise")])
    partial = [row for row in TRANSFORMER_TP_PLAN if row[0] != "norm"]
    with pytest.raises(ConfigError, match=r"norm\.weight"):
        resolve_sharding_plan(model, partial)
    styles = resolve_sharding_plan(model, TRANSFORMER_TP_PLAN)
    assert styles["layers.0.attention.wk"] == "colwise_kv_heads"
    assert styles["output"] == "vocab_head"


def _body_bad_apply(ctx: WorkerContext, kw: dict[str, object]) -> tuple[str, int]:
    mesh = ctx.mesh(tp=ctx.world_size)
    model = Transformer(_cfg(**kw), seed=0)
    try:
        apply_tensor_parallel(model, mesh)
    except ConfigError as e:
        return str(e), sum(int(v["calls"]) for v in mesh.stats.snapshot().values())
    return "no error", -1


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"dim": 48, "n_heads": 6, "n_kv_heads": 6}, "layers.0.attention.wq: 6 heads"),
        ({"dim": 48, "n_heads": 12, "n_kv_heads": 3}, "layers.0.attention.wk: 3 key/value"),
        ({"ffn_dim": 30}, "layers.0.feed_forward.w1: 30 output features"),
    ],
)
def test_apply_refuses_before_any_communication(
    pools: Pools, kw: dict[str, object], needle: str
) -> None:
    for msg, calls in pools(4).run(f"{M}:_body_bad_apply", kw):
        assert needle in msg and "tp=4" in msg
        assert calls == 0


def _body_bad_sequence(ctx: WorkerContext) -> tuple[str, int]:
    mesh = ctx.mesh(tp=ctx.world_size)
    model = apply_tensor_parallel(Transformer(_cfg(), seed=0), mesh, sequence_parallel=True)
    mesh.stats.reset()
    try:
        model(torch.zeros(2, 6, dtype=torch.long))
    except ConfigError as e:
        return str(e), sum(int(v["calls"]) for v in mesh.stats.snapshot().values())
    return "no error", -1


def test_sequence_parallel_refuses_indivisible_sequence(pools: Pools) -> None:
    for msg, calls in pools(4).run(f"{M}:_body_bad_sequence"):
        assert "length 6" in msg and "multiple of 4" in msg
        assert calls == 0


def _body_roundtrip(ctx: WorkerContext) -> tuple[bool, list[tuple[str, tuple[int, ...]]]]:
    """Shard one model, load another's full weights into it, gather them back."""
    mesh = ctx.mesh(tp=ctx.world_size)
    cfg = _cfg(tie_embeddings=True)  # kv 2 < tp 4: KV heads replicated; vocab 37 padded
    tp_model = apply_tensor_parallel(Transformer(cfg, seed=0), mesh)
    other = Transformer(cfg, seed=1).state_dict()
    load_full_state(tp_model, mesh, other)
    back = gather_full_state(tp_model, mesh)
    same = set(back) == set(other) and all(torch.equal(back[k], other[k]) for k in other)
    local = [(n, tuple(p.shape)) for n, p in tp_model.named_parameters()]
    return same, local


def test_gather_and_load_full_state_round_trip(pools: Pools) -> None:
    results = pools(4).run(f"{M}:_body_roundtrip")
    assert all(same for same, _ in results)
    shapes = dict(results[0][1])
    assert shapes["tok_embeddings.weight"] == (10, 32)  # 37 padded to 40, 10 rows per rank
    assert "output.weight" not in shapes  # tied: one shared shard
    assert shapes["layers.0.attention.wq.weight"] == (8, 32)  # 1 of 4 heads x head_dim 8
    assert shapes["layers.0.attention.wk.weight"] == (8, 32)  # 1 KV head, replicated x2
    assert shapes["layers.0.attention.wo.weight"] == (32, 8)
    assert shapes["layers.0.feed_forward.w2.weight"] == (32, 16)


def test_tp1_is_the_one_device_model() -> None:
    """The degenerate mesh (no process group): same loss and gradients as the model."""
    ref = Transformer(_cfg(n_layers=2), seed=3).double()
    mesh = init_mesh()
    from plait.parallel.tensor.loss import vocab_parallel_loss

    for sp in (False, True):
        model = apply_tensor_parallel(copy.deepcopy(ref), mesh, sequence_parallel=sp)
        x = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))
        y = x.roll(-1, 1)
        y[:, -1] = IGN
        want = F.cross_entropy(ref(x).reshape(-1, V), y.reshape(-1), ignore_index=IGN)
        got = vocab_parallel_loss(mesh, V)(model(x), y)
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want, **TOL)
        for (n1, p), (n2, q) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
            assert n1 == n2
            torch.testing.assert_close(q.grad, p.grad, **TOL)
        ref.zero_grad()
