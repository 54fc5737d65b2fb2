"""The mixture-of-experts feed-forward on one process: routing, losses, capacity.

* Routing: every token's output equals the weighted sum of its top-k experts applied to
  it alone (plus the shared expert), float64, rtol 1e-12.
* The load-balancing loss equals ``E · Σ_i f_i · P_i`` on a hand-made routing (a gate
  whose logits are chosen), and the z-loss ``mean(logsumexp²)``.
* With a capacity factor the dropped assignments are exactly those past an expert's
  capacity in the stated order (top-1 choices first, then by token index).
* The stacked-weight loop and the padded grouped matmul agree; the aux losses reach the
  router's gradient; active vs total parameter counts.
* Bad input refused with exit 2 before any work.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from plait.arch import flops_per_token, param_count
from plait.cli import main
from plait.config import ModelConfig
from plait.config.rules.layout import check_expert_parallel
from plait.errors import ConfigError
from plait.model.moe import MoE
from plait.model.transformer import Transformer
from tests.tiny import tiny_args

CFG = ModelConfig(
    vocab_size=64,
    dim=16,
    n_layers=2,
    n_heads=2,
    max_seq_len=16,
    moe_experts=4,
    moe_top_k=2,
    moe_hidden_dim=8,
    moe_shared_experts=1,
)


def _moe(**kw: object) -> MoE:
    torch.manual_seed(0)
    cfg = ModelConfig(**{**CFG.__dict__, **kw})  # type: ignore[arg-type]
    m = MoE(cfg).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m


def _expert(m: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    w = m.experts
    return (F.silu(x @ w.w1[e]) * (x @ w.w3[e])) @ w.w2[e]


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_output_is_weighted_sum_of_top_k_experts(router: str) -> None:
    m = _moe(moe_router=router)
    x = torch.randn(2, 5, CFG.dim, dtype=torch.float64)
    out = m(x).reshape(-1, CFG.dim)
    flat = x.reshape(-1, CFG.dim)
    logits = flat @ m.router.gate.weight.t()
    scores = torch.softmax(logits, -1) if router == "softmax" else torch.sigmoid(logits)
    for t in range(flat.shape[0]):
        top = scores[t].topk(2)
        w = top.values / top.values.sum()
        want = sum(w[i] * _expert(m, int(top.indices[i]), flat[t : t + 1]) for i in range(2))
        assert m.shared is not None
        want = want + m.shared(flat[t : t + 1])
        torch.testing.assert_close(out[t : t + 1], want, rtol=1e-12, atol=1e-14)


def test_aux_loss_on_a_hand_made_routing() -> None:
    m = _moe(moe_shared_experts=0, moe_top_k=1)
    # 4 tokens, one-hot inputs; the gate makes token t's logits row t of L
    L = torch.tensor(
        [[2.0, 0.0, 0.0, 0.0], [3.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.5, 0.0, 0.0]],
        dtype=torch.float64,
    )
    with torch.no_grad():
        m.router.gate.weight.zero_()
        m.router.gate.weight[:, :4] = L.t()
    x = torch.zeros(1, 4, CFG.dim, dtype=torch.float64)
    x[0, torch.arange(4), torch.arange(4)] = 1.0
    m(x)
    assert m.stats is not None
    # routing: tokens 0, 1 -> expert 0; token 2 -> expert 2; token 3 -> expert 1
    f = torch.tensor([2, 1, 1, 0], dtype=torch.float64) / 4
    p = torch.softmax(L, -1).mean(0)
    torch.testing.assert_close(m.stats.aux_loss, 4 * (f * p).sum(), rtol=1e-14, atol=0)
    z = torch.logsumexp(L, -1).pow(2).mean()
    torch.testing.assert_close(m.stats.z_loss, z, rtol=1e-14, atol=0)
    assert m.stats.load.tolist() == [2.0, 1.0, 1.0, 0.0]
    # uniform routing: the aux loss is exactly 1
    with torch.no_grad():
        m.router.gate.weight.zero_()
    m(x)
    assert m.stats is not None
    assert float(m.stats.aux_loss) == pytest.approx(1.0, abs=1e-14)


def test_capacity_drops_the_overflow_in_order() -> None:
    m = _moe(moe_shared_experts=0, moe_capacity_factor=0.5)  # cap = ceil(.5*6*2/4) = 2
    x = torch.randn(1, 6, CFG.dim, dtype=torch.float64)
    out = m(x).reshape(-1, CFG.dim)
    flat = x.reshape(-1, CFG.dim)
    scores = torch.softmax(flat @ m.router.gate.weight.t(), -1)
    top = scores.topk(2)
    cap = math.ceil(0.5 * 6 * 2 / 4)
    taken = [0] * 4
    kept: set[tuple[int, int]] = set()
    for slot in range(2):  # the stated order: top-1 choices first, then by token
        for t in range(6):
            e = int(top.indices[t, slot])
            if taken[e] < cap:
                taken[e] += 1
                kept.add((t, slot))
    dropped = 12 - len(kept)
    assert m.stats is not None and m.stats.dropped == dropped and dropped > 0
    for t in range(6):
        w = top.values[t] / top.values[t].sum()
        want = torch.zeros(1, CFG.dim, dtype=torch.float64)
        for slot in range(2):
            if (t, slot) in kept:
                want = want + w[slot] * _expert(m, int(top.indices[t, slot]), flat[t : t + 1])
        torch.testing.assert_close(out[t : t + 1], want, rtol=1e-12, atol=1e-14)


def test_grouped_matmul_equals_loop_and_aux_reaches_the_router() -> None:
    m = _moe()
    x = torch.randn(2, 7, CFG.dim, dtype=torch.float64, requires_grad=True)
    y1 = m(x)
    g1 = torch.autograd.grad(y1.sum(), [x, m.router.gate.weight])
    m.experts.grouped = True
    y2 = m(x)
    g2 = torch.autograd.grad(y2.sum(), [x, m.router.gate.weight])
    torch.testing.assert_close(y1, y2, rtol=1e-12, atol=1e-14)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    # with the losses' weight 0 the router gradient changes: the aux term is in backward
    m.experts.grouped = False
    m.aux_coef = m.z_coef = 0.0
    g3 = torch.autograd.grad(m(x).sum(), m.router.gate.weight)[0]
    assert not torch.allclose(g3, g1[1])


def test_active_and_total_parameters() -> None:
    model = Transformer(CFG, seed=1)
    assert param_count(CFG) == sum(p.numel() for p in model.parameters())
    expert = 3 * CFG.dim * 8
    # every layer is MoE: 4 experts held, 2 active per token
    assert param_count(CFG) - param_count(CFG, active=True) == CFG.n_layers * 2 * expert
    dense = ModelConfig(**{**CFG.__dict__, "moe_experts": 0, "ffn_dim": 3 * 8})  # type: ignore[arg-type]
    router = CFG.n_layers * CFG.dim * 4
    assert flops_per_token(CFG, 16) == flops_per_token(dense, 16) + 6 * router


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"moe_experts": 4, "moe_top_k": 5}, r"moe_top_k \(5\) must be between 1 and"),
        ({"moe_experts": 4, "moe_capacity_factor": -1.0}, "moe_capacity_factor must be >= 0"),
    ],
)
def test_model_fields_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**kw)  # type: ignore[arg-type]


def _bad(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(["train", *tiny_args(), *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("plait: error: ")
    return err


def test_bad_input_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    moe = ["--model.moe_experts", "4"]
    err = _bad(["--nproc", "4", "--dp", "2", "--tp", "2", "--ep", "4", *moe], capsys)
    assert "parallel.ep (4) must divide" in err and "dp x cp = 2" in err
    err = _bad(
        ["--nproc", "2", "--ep", "2", "--model.moe_experts", "3", "--model.moe_top_k", "1"], capsys
    )
    assert "moe_experts (3) is not divisible by parallel.ep (2)" in err
    err = _bad(["--nproc", "1", *moe, "--model.moe_top_k", "6"], capsys)
    assert "moe_top_k (6) must be between 1 and model.moe_experts (4)" in err
    err = _bad(["--nproc", "2", "--ep", "2"], capsys)
    assert "needs a mixture-of-experts model" in err
    err = _bad(["--nproc", "2", "--ep", "2", *moe, "--parallel.compression", "fp16"], capsys)
    assert "compression=fp16 is refused" in err
    err = _bad(["--nproc", "2", "--pp", "2", *moe, "--model.moe_aux_loss_scope", "model"], capsys)
    assert "moe_aux_loss_scope='model' is refused with parallel.pp=2" in err
    err = _bad(["--nproc", "1", *moe, "--model.moe_shared_expert_gate", "true"], capsys)
    assert "moe_shared_expert_gate gates the shared experts" in err


def test_ep_refuses_compression_only() -> None:
    """Of the layout rules beyond the sizes, ep > 1 refuses only gradient compression
    (ZeRO, 16-bit precision, pp and tp compose with it: no parameter of the check;
    tests/parallel/expert/test_expert_zero.py runs them)."""
    check_expert_parallel(2, 4, 1, 4)
    with pytest.raises(ConfigError, match="compression=fp16 is refused"):
        check_expert_parallel(2, 4, 1, 4, compression="fp16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_on_cuda_equals_cpu() -> None:
    """The same layer on CUDA (float64): output and gradients equal the CPU's; the loop
    and the padded grouped matmul agree there too."""
    m = _moe()
    x = torch.randn(2, 9, CFG.dim, dtype=torch.float64, requires_grad=True)
    want = m(x)
    gx = torch.autograd.grad(want.sum(), x)[0]
    m.cuda()
    for grouped in (False, True):
        m.experts.grouped = grouped
        xc = x.detach().cuda().requires_grad_()
        got = m(xc)
        gc = torch.autograd.grad(got.sum(), xc)[0]
        torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(gc.cpu(), gx, rtol=1e-10, atol=1e-12)
