"""Blockwise (online-softmax) attention against scaled_dot_product_attention, float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from plait.model.blockwise_attention import blockwise_attention, merge

TOL = dict(rtol=1e-10, atol=1e-10)


def _inputs(b: int, h: int, hk: int, s: int, d: int, sk: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    sk = s if sk is None else sk
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    return mk(b, h, s, d), mk(b, hk, sk, d), mk(b, hk, sk, d)


def _reference(q, k, v, causal):
    g = q.shape[1] // k.shape[1]
    ke, _ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = q @ ke.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=g > 1)
    return out, lse


@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("h", "hk", "s", "block"), [(4, 4, 16, 4), (4, 2, 13, 4), (6, 2, 7, 3)])
def test_matches_sdpa(impl, causal, h, hk, s, block):
    q, k, v = _inputs(2, h, hk, s, 8)
    out, lse = blockwise_attention(q, k, v, causal=causal, block_size=block, impl=impl)
    ref_out, ref_lse = _reference(q, k, v, causal)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    for with_lse in (False, True):
        got = torch.autograd.grad(
            (out * dout).sum() + with_lse * (lse * dlse).sum(), (q, k, v), retain_graph=True
        )
        want = torch.autograd.grad(
            (ref_out * dout).sum() + with_lse * (ref_lse * dlse).sum(),
            (q, k, v),
            retain_graph=True,
        )
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **TOL)


def test_non_causal_cross_lengths():
    q, k, v = _inputs(1, 2, 1, 5, 4, sk=11)
    out, _lse = blockwise_attention(q, k, v, block_size=4)
    torch.testing.assert_close(out, _reference(q, k, v, False)[0], **TOL)


def test_merge_of_disjoint_key_blocks_equals_union():
    q, k, v = _inputs(2, 4, 2, 9, 8, sk=14)
    a = blockwise_attention(q, k[:, :, :5], v[:, :, :5], block_size=3)
    b = blockwise_attention(q, k[:, :, 5:], v[:, :, 5:], block_size=3)
    out, lse = merge(*a, *b)
    ref_out, ref_lse = _reference(q, k, v, False)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    # merging an empty side (lse = -inf) changes nothing
    empty = torch.full_like(lse, float("-inf"))
    o2, _l2 = merge(out, lse, torch.zeros_like(out), empty)
    torch.testing.assert_close(o2, out, **TOL)


def _saved_bytes(s: int, fn) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    q, k, v = _inputs(1, 2, 2, s, 8)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(q, k, v)
    return total


def test_saved_bytes_grow_linearly_in_sequence():
    blockwise = lambda q, k, v: blockwise_attention(q, k, v, causal=True, block_size=16)  # noqa: E731
    small, big = _saved_bytes(64, blockwise), _saved_bytes(256, blockwise)
    assert big == 4 * small  # O(s·d): q, k, v, out and lse
    assert big <= 5 * 2 * 256 * 8 * 8  # at most five (heads, seq, head_dim) float64 tensors
    # the naive path saves the (s, s) probabilities: quadratic
    naive = lambda q, k, v: _reference(q, k, v, True)  # noqa: E731
    assert _saved_bytes(256, naive) > 8 * _saved_bytes(64, naive)


def test_refusals():
    q, k, v = _inputs(1, 3, 2, 4, 4)
    with pytest.raises(ValueError, match="multiple"):
        blockwise_attention(q, k, v)
    q, k, v = _inputs(1, 2, 2, 4, 4, sk=6)
    with pytest.raises(ValueError, match="causal"):
        blockwise_attention(q, k, v, causal=True)


def test_model_attention_blockwise_matches_sdpa():
    """``model.attention = blockwise`` gives the built-in model's loss and gradients of
    ``sdpa`` (float64)."""
    from plait.config import ModelConfig
    from plait.model import BlockwiseAttention, Transformer

    results = []
    for kind in ("sdpa", "blockwise"):
        cfg = ModelConfig(
            vocab_size=32,
            dim=16,
            n_heads=4,
            n_kv_heads=2,
            n_layers=2,
            max_seq_len=24,
            attention=kind,
        )
        model = Transformer(cfg, seed=1).double()
        if kind == "blockwise":
            assert isinstance(model.layers[0].attention.core, BlockwiseAttention)
            for layer in model.layers:
                layer.attention.core.block_size = 5  # several blocks, a ragged last one
        tokens = torch.randint(0, 32, (2, 23), generator=torch.Generator().manual_seed(0))
        loss = model.loss(model(tokens), tokens)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], **TOL)
    for a, b in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(a, b, **TOL)
