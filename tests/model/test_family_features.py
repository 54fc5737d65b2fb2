"""The block features of the Hugging Face families under every layout they meet.

Two tiny float64 models carry every feature: Qwen3-shaped (q/k RMSNorm per head, a head
width other than dim / n_heads, biases on q/k/v/o) and OLMo-2-shaped (q/k RMSNorm over
the whole projection, post-norm blocks, q/k/v biases, one key/value head so that tp2
replicates it and the k norm's sums of squares are divided by the replicas). Their
biases and norm gains are drawn at random (not the init's zeros and ones) so that a
bias split wrongly over tp, or one added twice, shows. Five AdamW steps under dp2,
ZeRO-3 dp2, tp2 with sequence parallelism, pp2, cp2 ring and cp2 Ulysses equal plain
PyTorch on one process (loss per step, rel 1e-9: the norms compute in float32, as
transformers' do, so a layout's other summation order can flip the last float32 bit of
a normalised value; seen at 8e-10 after five steps under OLMo 2's post-norm, where the
norm's output is the residual stream; a wrong feature moves the loss by 1e-3 or more).

A third, Gemma-3-shaped model carries Gemma's features: (1 + w) norm gains (drawn at
random, every norm), the sqrt(dim) embedding scale, GeGLU, four norms per block, the
score scale of query_pre_attn_scalar, attention- and final-logit soft-capping (small
caps, so that they bind), a sliding layer (window 6 < 16) with its own RoPE base beside a
full layer with linearly scaled RoPE, tied embeddings; under dp2, ZeRO-3, tp2+SP and
pp2. Context parallelism refuses it by name (its kernels neither scale nor cap).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plait.arch.families.common import GEMMA_FEATURES
from plait.config import ModelConfig, ParallelConfig
from plait.errors import ConfigError
from plait.model.transformer import Transformer
from plait.optim import Optimizer
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext, WorkerPool

STEPS, BATCH, SEQ, VOCAB, LR = 5, 4, 16, 64, 1e-2

FEATURES = {
    "qwen3": {"qk_norm": "head", "head_width": 16, "attention_bias": "qkvo", "n_kv_heads": 2},
    "olmo2": {
        "qk_norm": "projection",
        "norm_placement": "post",
        "attention_bias": "qkv",
        "n_kv_heads": 1,
    },
    "gemma": {
        "qk_norm": "head",
        "head_width": 16,
        "n_kv_heads": 2,
        "norm_placement": "sandwich",
        "norm_unit_offset": True,
        "embedding_scale": True,
        "activation": "gelu_tanh",
        "query_pre_attn_scalar": 12.0,
        "attn_logit_softcap": 2.0,
        "final_logit_softcap": 3.0,
        "sliding_window": 6,
        "layer_types": ("sliding_attention", "full_attention"),
        "rope_local_theta": 100.0,
        "rope_scaling": "linear",
        "rope_factor": 2.0,
        "tie_embeddings": True,
    },
}


def _model(kind: str) -> Transformer:
    cfg = ModelConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, max_seq_len=SEQ, **FEATURES[kind]
    )
    model = Transformer(cfg, seed=3).double()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            qk = ".attention.q_norm" in name or ".attention.k_norm" in name
            if name.endswith(".bias") or qk or (kind == "gemma" and "norm" in name):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [
        (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),) * 1
        + (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),)
        for _ in range(STEPS)
    ]


def _reference(kind: str) -> list[float]:
    model = _model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _body(ctx: WorkerContext, kind: str, layout: dict[str, Any]) -> list[float] | list[str]:
    tp, pp, cp = layout.get("tp", 1), layout.get("pp", 1), layout.get("cp", 1)
    dp = ctx.world_size // (tp * pp * cp)
    mesh = ctx.mesh(dp=dp, tp=tp, pp=pp, cp=cp)
    cfg = ParallelConfig(
        microbatches=2,
        sequence_parallel=layout.get("sp", False),
        cp_attention=layout.get("cp_attention", "ring"),
    )
    try:
        pm = parallelize(_model(kind), mesh, cfg, zero=layout.get("zero", 0))
    except ConfigError as e:
        return [str(e)]
    opt = Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=LR))
    per, r = BATCH // dp, mesh.index("dp")
    losses = []
    for x, y in _batches():
        losses.append(float(pm.step(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])))
        opt.step()
        opt.zero_grad()
    return losses


@pytest.fixture(scope="module")
def refs() -> dict[str, list[float]]:
    return {kind: _reference(kind) for kind in FEATURES}


LAYOUTS = [
    {},
    {"zero": 3},
    {"tp": 2, "sp": True},
    {"pp": 2},
    {"cp": 2},
    {"cp": 2, "cp_attention": "ulysses"},
]


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda v: "-".join(f"{k}{v[k]}" for k in v) or "dp2"
)
@pytest.mark.parametrize("kind", list(FEATURES))
def test_features_under_layouts_equal_one_process(
    pools: Callable[[int], WorkerPool],
    refs: dict[str, list[float]],
    kind: str,
    layout: dict[str, Any],
) -> None:
    for losses in pools(2).run(_body, kind, layout):
        if kind == "gemma" and layout.get("cp"):
            assert "context parallelism (cp = 2) does not do the attention" in str(losses[0])
            continue
        assert losses == pytest.approx(refs[kind], rel=1e-9)


def test_gemma_features_change_the_model() -> None:
    """Each Gemma feature moves the logits (so the layouts above compare something)."""
    base = _model("gemma")
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    want = base(x)
    off = {**GEMMA_FEATURES, "sliding_window": None}  # every feature at its off value
    for field, value in off.items():
        cfg = ModelConfig(**{**base.cfg.__dict__, field: value})
        other = Transformer(cfg, seed=3).double()
        other.load_state_dict(base.state_dict())
        assert not torch.allclose(other(x), want, rtol=1e-3, atol=1e-3), field


def test_softcap_is_refused_by_the_blockwise_kernel() -> None:
    with pytest.raises(ConfigError, match=r"attn_logit_softcap needs model\.attention = 'sdpa'"):
        ModelConfig(attn_logit_softcap=50.0, attention="blockwise")
