"""Document masking on one process (float64): document ids, the block-causal mask in
SDPA and blockwise attention, and the loss of a window equal to its documents' losses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.config import ModelConfig
from plait.model import Transformer
from plait.model.blockwise_attention import blockwise_attention
from plait.model.document_mask import DocumentIds, document_ids
from plait.model.transformer import doc_sdpa

EOS, VOCAB, SEQ = 0, 32, 24
TOL = dict(rtol=1e-10, atol=1e-10)


def _tokens(batch: int, seq: int, eos_at: list[list[int]], seed: int = 0) -> torch.Tensor:
    """Random non-EOS tokens ``(batch, seq)`` with EOS at the given positions per row."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(1, VOCAB, (batch, seq), generator=g)
    for row, where in enumerate(eos_at):
        t[row, where] = EOS
    return t


def test_document_ids_start_after_each_eos() -> None:
    t = torch.tensor([[5, 0, 7, 7, 0, 0, 3], [0, 1, 2, 3, 4, 5, 6]])
    want = torch.tensor([[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]])
    assert torch.equal(document_ids(t, 0), want)
    assert DocumentIds()(t) is None  # no EOS id: masking off


def _qkv(b: int, h: int, hk: int, s: int, d: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    return mk(b, h, s, d), mk(b, hk, s, d), mk(b, hk, s, d)


def _masked_reference(q, k, v, docs):
    """Plain SDPA with the explicit block-causal boolean mask."""
    s = q.shape[2]
    mask = (docs[:, None, :, None] == docs[:, None, None, :]) & torch.ones(s, s).tril().bool()
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask
    )


@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize("block", [3, 5, 16])
def test_blockwise_with_documents_equals_masked_sdpa(impl: str, block: int) -> None:
    """Values and q/k/v gradients equal SDPA with the boolean mask (GQA 4:2, ragged
    blocks, documents of 1 token and blocks that see no key of another block)."""
    tokens = _tokens(2, 16, [[0, 1, 6, 12], [9]])
    docs = document_ids(tokens, EOS)
    q, k, v = _qkv(2, 4, 2, 16)
    out, _lse = blockwise_attention(q, k, v, causal=True, block_size=block, impl=impl, doc_ids=docs)  # type: ignore[arg-type]
    want = _masked_reference(q, k, v, docs)
    torch.testing.assert_close(out, want, **TOL)
    assert doc_sdpa(q, k, v, docs).sub(want).abs().max() < 1e-12
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(want, (q, k, v), dout)
    for a, b in zip(got, ref, strict=True):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, **TOL)


def _model(kind: str) -> Transformer:
    cfg = ModelConfig(
        vocab_size=VOCAB,
        dim=16,
        n_heads=4,
        n_kv_heads=2,
        n_layers=2,
        max_seq_len=SEQ,
        attention=kind,
    )
    model = Transformer(cfg, seed=1).double()
    if kind == "blockwise":
        for layer in model.layers:
            layer.attention.core.block_size = 5  # type: ignore[union-attr]
    return model


@pytest.mark.parametrize("kind", ["sdpa", "blockwise"])
def test_window_loss_is_the_sum_of_its_documents_losses(kind: str) -> None:
    """With the mask the summed token losses of a window (three documents, the EOS the
    last token of each) equal the sum over its documents run alone (from position 0:
    rotary scores depend only on position differences). Without the mask they differ.
    The one-device path runs the blockwise forward in blocks of 5 with the masks of each
    key range."""
    model = _model(kind)
    tokens = _tokens(1, SEQ, [[6, 15]], seed=4)
    targets = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(5))

    def summed(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1), reduction="sum")

    plain = summed(model(tokens), targets)
    model.documents = DocumentIds(EOS)
    window = summed(model(tokens), targets)
    model.documents = DocumentIds()
    parts = sum(
        summed(model(tokens[:, a:b]), targets[:, a:b]) for a, b in ((0, 7), (7, 16), (16, SEQ))
    )
    # rtol 1e-9: the rotary tables are float32, so the same position difference taken
    # at other absolute positions differs in rounding (measured ~4e-12)
    torch.testing.assert_close(window, parts, rtol=1e-9, atol=0.0)
    assert abs(float((plain - window).detach())) > 1e-3
    # explicit doc_ids give the same as the module
    ids = document_ids(tokens, EOS)
    torch.testing.assert_close(summed(model(tokens, ids), targets), window, rtol=1e-12, atol=1e-12)
