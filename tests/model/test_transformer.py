"""Single-device tests of the built-in transformer: shapes, causality, init, accounting."""

from __future__ import annotations

import dataclasses
import resource
import time

import pytest
import torch

from plait.arch import param_count
from plait.config import ModelConfig
from plait.errors import ConfigError
from plait.model import (
    IGNORE_INDEX,
    MODEL_PRESETS,
    Transformer,
    lm_loss,
    materialize,
    model_preset,
)


def tiny(**changes: object) -> ModelConfig:
    return dataclasses.replace(model_preset("tiny"), **changes)


def tokens(batch: int = 2, seq: int = 16, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def test_forward_shape_and_loss() -> None:
    cfg = tiny()
    model = Transformer(cfg, seed=0)
    x = tokens()
    logits = model(x)
    assert logits.shape == (2, 16, cfg.vocab_size)
    loss = model.loss(logits, x)
    assert loss.ndim == 0
    # Near-uniform predictions at init: loss close to log(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_loss_ignores_index() -> None:
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    masked = targets.clone()
    masked[:, 3:] = IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(
        logits[:, :3].reshape(-1, 7), targets[:, :3].reshape(-1)
    )
    torch.testing.assert_close(lm_loss(logits, masked), expected)


@pytest.mark.parametrize("kv_heads", [None, 2, 1])
def test_causal(kv_heads: int | None) -> None:
    model = Transformer(tiny(n_kv_heads=kv_heads), seed=1)
    x = tokens(seq=20)
    y = x.clone()
    y[:, 12] = (y[:, 12] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_gqa_matches_repeated_heads() -> None:
    """A GQA model equals the MHA model whose KV heads are the repeated GQA heads."""
    gqa_cfg = tiny(n_kv_heads=2)
    gqa = Transformer(gqa_cfg, seed=3)
    assert gqa.layers[0].attention.wk.weight.shape == (2 * gqa_cfg.head_dim, gqa_cfg.dim)
    mha = Transformer(tiny(n_kv_heads=4), seed=3)
    state = gqa.state_dict()
    hd = gqa_cfg.head_dim
    for key in list(state):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            w = state[key].view(2, hd, gqa_cfg.dim)  # (kv_heads, head_dim, dim)
            state[key] = w.repeat_interleave(2, dim=0).reshape(4 * hd, gqa_cfg.dim)
    mha.load_state_dict(state)
    x = tokens(seq=10)
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x))


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("kv_heads", [None, 1])
def test_param_count_matches_numel(tie: bool, kv_heads: int | None) -> None:
    cfg = tiny(tie_embeddings=tie, n_kv_heads=kv_heads, ffn_dim=48)
    model = Transformer(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)
    vocab_mats = cfg.vocab_size * cfg.dim * (1 if tie else 2)
    assert param_count(cfg, include_embeddings=False) == param_count(cfg) - vocab_mats
    if tie:
        assert model.output.weight is model.tok_embeddings.weight


def test_meta_build_7b_is_fast_and_allocation_free() -> None:
    cfg = model_preset("llama2-7b")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(cfg)
    elapsed = time.perf_counter() - start
    rss_growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert elapsed < 5.0
    assert rss_growth_mib < 256
    assert all(p.is_meta for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())
    assert n == param_count(cfg)
    assert abs(n - 6.74e9) / 6.74e9 < 0.001
    out = model(torch.zeros(1, 8, dtype=torch.long, device="meta"))
    assert out.shape == (1, 8, cfg.vocab_size)


def test_model_presets() -> None:
    assert model_preset("small") == ModelConfig()
    assert model_preset("tiny") is not MODEL_PRESETS["tiny"]
    with pytest.raises(ConfigError, match="unknown model preset"):
        model_preset("nope")


@pytest.mark.parametrize("tie", [False, True])
def test_materialize_equals_direct_build(tie: bool) -> None:
    cfg = tiny(tie_embeddings=tie)
    direct = Transformer(cfg, seed=7)
    with torch.device("meta"):
        lazy = Transformer(cfg)
    materialize(lazy, "cpu", seed=7)
    if tie:
        assert lazy.output.weight is lazy.tok_embeddings.weight
    a, b = direct.state_dict(), lazy.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    torch.testing.assert_close(direct.rope_cos, lazy.rope_cos, rtol=0, atol=0)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(direct(x), lazy(x), rtol=0, atol=0)


def test_seed_determinism_and_init_scale() -> None:
    cfg = tiny(n_layers=4)
    a, b, c = Transformer(cfg, seed=5), Transformer(cfg, seed=5), Transformer(cfg, seed=6)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if "norm" in name:
            assert torch.equal(pa, torch.ones_like(pa))
        else:
            assert not torch.equal(pa, pc), name
    big = Transformer(dataclasses.replace(cfg, dim=256, n_heads=4, n_kv_heads=4), seed=0)
    std_q = big.layers[0].attention.wq.weight.std().item()
    std_o = big.layers[0].attention.wo.weight.std().item()
    assert abs(std_q - 0.02) < 0.002
    assert abs(std_o - 0.02 / (2 * 4) ** 0.5) < 0.001
    torch.manual_seed(0)
    d = Transformer(cfg)
    torch.manual_seed(0)
    e = Transformer(cfg)
    assert all(torch.equal(p, q) for p, q in zip(d.parameters(), e.parameters(), strict=True))


def test_overfits_a_repeated_batch() -> None:
    torch.manual_seed(0)
    model = Transformer(tiny(), seed=0)
    data = tokens(batch=4, seq=33, seed=1)
    x, y = data[:, :-1], data[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss = model.loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_rejects_too_long_sequence() -> None:
    model = Transformer(tiny(), seed=0)
    with pytest.raises(ConfigError, match="max_seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))
