"""plait's MoE layer against ``transformers``' own MoE blocks on the same weights.

Each case builds ``transformers``' block from a tiny config (Mixtral's sparse block:
softmax, top-2 always renormalised; Qwen2-MoE's: top-k not renormalised, a shared
expert of another width scaled by ``sigmoid(x · w_gate)``; Qwen3-MoE's: top-3 of 6
renormalised), copies its weights into :class:`~plait.model.moe.MoE` through
:mod:`plait.checkpoint.hf_experts` (the fused in-memory layout), and compares the
outputs and the gradients of the input and of every weight (float64, rtol 1e-10).
A whole 2-layer Mixtral mapped into plait's Transformer gives the same logits, aux loss
and training gradients (the family's objective; float32 bounds, see its test). The
load-balancing loss of two MoE layers linked as one model (scope 'model') equals
``load_balancing_loss_func`` over both layers' router logits, value and router
gradients (float64, rtol 1e-10), and a layer's own ``stats.aux_loss`` equals that
function on its logits alone.

``transformers`` computes the router probabilities in float32 (``.float()``,
``softmax(dtype=torch.float)``); :func:`_float64_routing` keeps float64 ones float64 so
that the comparison can be at 1e-10 (and ``load_balancing_loss_func``'s float32 count
histogram float64; ``test_float32_blocks_agree`` compares the
unpatched blocks in float32, rtol and atol 1e-5).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.checkpoint.hf_experts import from_fused
from plait.config import ModelConfig
from plait.model.moe import MoE
from plait.model.moe_aux import link_model_aux

transformers = pytest.importorskip("transformers")

DIM, F = 16, 8


def _float64_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let ``transformers``' routers keep float64 logits in float64."""
    to_float = torch.Tensor.float
    softmax = torch.nn.functional.softmax

    def keep(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == torch.float64 else to_float(t)

    def softmax64(x: torch.Tensor, dim: Any = None, *args: Any, dtype: Any = None) -> Any:
        return softmax(x, dim, *args, dtype=None if x.dtype == torch.float64 else dtype)

    monkeypatch.setattr(torch.Tensor, "float", keep)
    monkeypatch.setattr(torch.nn.functional, "softmax", softmax64)


def _case(name: str) -> tuple[torch.nn.Module, ModelConfig]:
    """``transformers``' block and the plait config of the same layer."""
    common: dict[str, Any] = {"hidden_size": DIM, "num_attention_heads": 2}
    plait: dict[str, Any] = {
        "dim": DIM, "n_heads": 2, "moe_hidden_dim": F, "moe_aux_loss_coef": 0.0,
        "moe_z_loss_coef": 0.0, "moe_aux_loss_scope": "model",
    }  # fmt: skip
    if name == "mixtral":
        from transformers.models.mixtral import modeling_mixtral as mm

        cfg = transformers.MixtralConfig(
            **common, intermediate_size=F, num_local_experts=4, num_experts_per_tok=2
        )
        block = mm.MixtralSparseMoeBlock(cfg)
        return block, ModelConfig(**plait, moe_experts=4, moe_top_k=2)
    if name == "qwen2_moe":
        from transformers.models.qwen2_moe import modeling_qwen2_moe as qm

        cfg = transformers.Qwen2MoeConfig(
            **common, moe_intermediate_size=F, shared_expert_intermediate_size=2 * F,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        )  # fmt: skip
        block = qm.Qwen2MoeSparseMoeBlock(cfg)
        return block, ModelConfig(
            **plait, moe_experts=4, moe_top_k=2, moe_norm_topk_prob=False,
            moe_shared_experts=2, moe_shared_expert_gate=True,
        )  # fmt: skip
    from transformers.models.qwen3_moe import modeling_qwen3_moe as q3

    cfg = transformers.Qwen3MoeConfig(
        **common, moe_intermediate_size=F, num_experts=6, num_experts_per_tok=3,
        norm_topk_prob=True,
    )  # fmt: skip
    return q3.Qwen3MoeSparseMoeBlock(cfg), ModelConfig(**plait, moe_experts=6, moe_top_k=3)


def _pair(name: str, dtype: torch.dtype) -> tuple[torch.nn.Module, MoE, list[tuple[Any, Any]]]:
    """Both layers on the same random weights; the (transformers, plait) weight pairs
    whose gradients must agree (expert tensors in plait's layout)."""
    torch.manual_seed(0)
    block, cfg = _case(name)
    block = block.to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    ours = MoE(cfg).to(dtype)
    ex = block.experts  # type: ignore[attr-defined]
    pairs: list[tuple[Any, Any]] = [(block.gate.weight, ours.router.gate.weight)]  # type: ignore[attr-defined]
    with torch.no_grad():
        ours.router.gate.weight.copy_(block.gate.weight)  # type: ignore[attr-defined]
        for which, w in from_fused(ex.gate_up_proj, ex.down_proj).items():
            getattr(ours.experts, which).copy_(w)
        if ours.shared is not None:
            sh = block.shared_expert  # type: ignore[attr-defined]
            for hf, mine in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                getattr(ours.shared, mine).weight.copy_(getattr(sh, hf).weight)
                pairs.append((getattr(sh, hf).weight, getattr(ours.shared, mine).weight))
            assert ours.shared_gate is not None
            ours.shared_gate.weight.copy_(block.shared_expert_gate.weight)  # type: ignore[attr-defined]
            pairs.append((block.shared_expert_gate.weight, ours.shared_gate.weight))  # type: ignore[attr-defined]
    return block, ours, pairs


def _compare(name: str, dtype: torch.dtype, rtol: float, atol: float) -> None:
    block, ours, pairs = _pair(name, dtype)
    x = torch.randn(2, 5, DIM, dtype=dtype)
    probe = torch.randn(2, 5, DIM, dtype=dtype)  # a loss that weighs every output
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    want, got = block(xs[0]), ours(xs[1])
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    (want * probe).sum().backward()
    (got * probe).sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=rtol, atol=atol)
    for hf, mine in pairs:
        torch.testing.assert_close(mine.grad, hf.grad, rtol=rtol, atol=atol)
    ex = block.experts  # type: ignore[attr-defined]
    grads = from_fused(ex.gate_up_proj.grad, ex.down_proj.grad)
    for which, g in grads.items():
        torch.testing.assert_close(getattr(ours.experts, which).grad, g, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_block_equals_transformers(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    _float64_routing(monkeypatch)
    _compare(name, torch.float64, 1e-10, 1e-12)


def test_float32_blocks_agree() -> None:
    """The stock blocks (float32 routing, no patch) in float32 (rtol, atol 1e-5)."""
    for name in ("mixtral", "qwen2_moe"):
        _compare(name, torch.float32, 1e-5, 1e-5)


def test_model_aux_loss_equals_load_balancing_loss_func(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two MoE layers of one model (scope 'model'), coefficient 0.3: the linked share's
    loss equals ``load_balancing_loss_func`` over both layers' logits, and the router
    gradients of the aux term alone (the outputs' gradient zero) equal 0.3 times that
    function's; one layer's stats equal the function on its logits alone. The counts
    differ between the layers, so the per-layer sum would not match."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    _float64_routing(monkeypatch)
    histc = torch.histc  # the function counts in float32 (exact); let the sum be float64
    monkeypatch.setattr(torch, "histc", lambda x, *a, **k: histc(x.double(), *a, **k))
    cfg = ModelConfig(
        dim=DIM, n_heads=2, moe_experts=4, moe_top_k=2, moe_hidden_dim=F,
        moe_aux_loss_coef=0.3, moe_z_loss_coef=0.0, moe_aux_loss_scope="model",
    )  # fmt: skip
    torch.manual_seed(1)
    layers = [MoE(cfg).double() for _ in range(2)]
    share = link_model_aux(layers)
    assert share is not None and share.layers == 2
    xs = [torch.randn(3, 4, DIM, dtype=torch.float64) for _ in range(2)]
    ws = []
    for m in layers:
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.5)
            m.router.gate.weight.normal_(0, 1.0)
        ws.append(m.router.gate.weight.detach().clone().requires_grad_())
    outs = [m(x) for m, x in zip(layers, xs, strict=True)]
    logits = tuple(
        torch.nn.functional.linear(x.reshape(-1, DIM), w) for x, w in zip(xs, ws, strict=True)
    )
    want = load_balancing_loss_func(logits, 4, 2)
    torch.testing.assert_close(share.loss(), want.detach(), rtol=1e-10, atol=0)
    per_layer = sum(float(m.stats.aux_loss) for m in layers if m.stats is not None) / 2
    assert abs(per_layer - float(want.detach())) > 1e-3  # the layers' counts differ
    (0.3 * want).backward()
    sum((o * 0).sum() for o in outs).backward()  # type: ignore[union-attr]
    for m, w in zip(layers, ws, strict=True):
        torch.testing.assert_close(m.router.gate.weight.grad, w.grad, rtol=1e-10, atol=1e-14)
    for m, lg in zip(layers, logits, strict=True):
        assert m.stats is not None
        one = load_balancing_loss_func((lg.detach(),), 4, 2)
        torch.testing.assert_close(m.stats.aux_loss, one, rtol=1e-10, atol=0)


_LLAMA_NAMES = (  # (transformers suffix, plait suffix) inside layer i
    ("self_attn.q_proj.weight", "attention.wq.weight"),
    ("self_attn.k_proj.weight", "attention.wk.weight"),
    ("self_attn.v_proj.weight", "attention.wv.weight"),
    ("self_attn.o_proj.weight", "attention.wo.weight"),
    ("input_layernorm.weight", "attention_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate.weight", "feed_forward.router.gate.weight"),
)


def test_mixtral_model_equals_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-layer ``MixtralForCausalLM`` mapped into plait's Transformer (Llama's names,
    the experts through :func:`from_fused`) with the family's objective (top-2
    renormalised, the model-wide aux loss weighted by ``router_aux_loss_coef`` = 0.1, no
    z-loss): logits, the aux loss and every gradient of ``transformers``' training loss
    (``output_router_logits``) equal plait's. Float64, but ``transformers``' RMSNorm and
    rotary tables compute in float32 whatever the model's dtype, so the bounds are
    float32's: logits and aux loss rtol 1e-5 (atol 1e-5), gradients rtol 1e-4 (atol
    1e-5); the routing itself is compared at 1e-10 above."""
    from plait.model.transformer import Transformer

    _float64_routing(monkeypatch)
    histc = torch.histc
    monkeypatch.setattr(torch, "histc", lambda x, *a, **k: histc(x.double(), *a, **k))
    hf_cfg = transformers.MixtralConfig(
        vocab_size=32, hidden_size=DIM, intermediate_size=F, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, router_aux_loss_coef=0.1, output_router_logits=True,
        max_position_embeddings=16, experts_implementation="eager",  # float64: no grouped_mm
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(hf_cfg).double()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "layernorm" not in n and n != "model.norm.weight":
                p.normal_(0, 0.3)
    cfg = ModelConfig(
        vocab_size=32, dim=DIM, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=16,
        rope_theta=hf_cfg.rope_parameters["rope_theta"], norm_eps=hf_cfg.rms_norm_eps,
        moe_experts=4, moe_top_k=2, moe_hidden_dim=F, moe_aux_loss_coef=0.1,
        moe_z_loss_coef=0.0, moe_aux_loss_scope="model",
    )  # fmt: skip
    ours = Transformer(cfg, seed=0).double()
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    mine = dict(ours.named_parameters())
    theirs = dict(hf.named_parameters())
    top = (("model.embed_tokens.weight", "tok_embeddings.weight"),
           ("model.norm.weight", "norm.weight"), ("lm_head.weight", "output.weight"))  # fmt: skip
    names = list(top) + [
        (f"model.layers.{i}.{a}", f"layers.{i}.{b}") for i in range(2) for a, b in _LLAMA_NAMES
    ]
    with torch.no_grad():
        for a, b in names:
            mine[b].copy_(theirs[a])
            pairs.append((theirs[a], mine[b]))
        for i in range(2):
            ex = hf.model.layers[i].mlp.experts
            for which, w in from_fused(ex.gate_up_proj, ex.down_proj).items():
                mine[f"layers.{i}.feed_forward.experts.{which}"].copy_(w)
    tokens = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(3))
    out = hf(tokens, labels=tokens)
    logits = ours(tokens)
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)
    share = ours.layers[0].feed_forward.aux_share
    assert share is not None and share.layers == 2
    torch.testing.assert_close(share.loss(), out.aux_loss.detach(), rtol=1e-5, atol=0)
    out.loss.backward()  # cross-entropy + 0.1 x aux, as transformers trains Mixtral
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 32), tokens[:, 1:].reshape(-1)
    )
    ce.backward()  # plait: the aux term enters through the MoE layers' backward
    for a, b in pairs:
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)
    for i in range(2):
        ex = hf.model.layers[i].mlp.experts
        for which, g in from_fused(ex.gate_up_proj.grad, ex.down_proj.grad).items():
            got = mine[f"layers.{i}.feed_forward.experts.{which}"].grad
            torch.testing.assert_close(got, g, rtol=1e-4, atol=1e-5)
