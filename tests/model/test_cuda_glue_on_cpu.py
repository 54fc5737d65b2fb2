"""The CUDA kernels' glue, run on the CPU: each CUDA aten op is replaced by a stand-in
with the op's exact positional signature, built on the CPU flash kernel, that returns
what the CUDA op returns (the efficient kernel's log-sum-exp padded to a multiple of 32
rows with garbage, cuDNN's ``(b, h, sq, 1)``) and checks what it is given (a dense
log-sum-exp of the right shape, the mask in q's dtype and per head). Blockwise and ring
attention through each stand-in then equal SDPA in float64 (1e-10): the slicing,
padding and reshaping around the CUDA calls is right. (The stand-ins keep the
log-sum-exp in q's dtype, float64 here, as the glue passes it on; on CUDA the kernels
see 16-bit inputs and a float32 log-sum-exp.)"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plait.model import attention_kernels as kernels
from plait.model.blockwise_attention import blockwise_attention
from plait.model.document_mask import document_ids

cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _mask(bias: torch.Tensor | None, q: torch.Tensor, sk: int) -> torch.Tensor | None:
    if bias is None:
        return None
    assert bias.dtype == q.dtype and bias.shape == (q.shape[0], q.shape[1], q.shape[2], sk)
    return bias.contiguous()


def _flash(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):  # type: ignore[no-untyped-def]
    assert dropout_p == 0.0 and not return_debug_mask
    out, lse = cpu_fwd(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, is_causal, scale=scale)
    return out, lse, None, None, q.shape[2], k.shape[2], None, None, None


def _flash_bwd(g, q, k, v, out, lse, cq, ck, mq, mk, p, causal, seed, off, *, scale):  # type: ignore[no-untyped-def]
    assert cq is None and ck is None and (mq, mk) == (q.shape[2], k.shape[2]) and p == 0.0
    assert lse.is_contiguous() and lse.shape == q.shape[:3] and lse.dtype == q.dtype
    return cpu_bwd(
        g,
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        out,
        lse.to(q.dtype),
        0.0,
        causal,
        scale=scale,
    )


def _eff(q, k, v, bias, compute_lse, dropout_p, is_causal, *, scale):  # type: ignore[no-untyped-def]
    assert compute_lse and dropout_p == 0.0
    m = _mask(bias, q, k.shape[2])
    out, lse = cpu_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, is_causal, attn_mask=m, scale=scale
    )
    rows = math.ceil(q.shape[2] / 32) * 32
    padded = torch.full((*q.shape[:2], rows), 123.0, dtype=lse.dtype)  # garbage padding
    padded[..., : q.shape[2]] = lse
    return out, padded, torch.empty(()), torch.empty(())


def _eff_bwd(g, q, k, v, bias, out, lse, seed, off, p, mask_in, causal, *, scale):  # type: ignore[no-untyped-def]
    sq = q.shape[2]
    assert lse.shape == (*q.shape[:2], math.ceil(sq / 32) * 32) and lse.is_contiguous()
    assert list(mask_in) == [True, True, True, False] and p == 0.0
    m = _mask(bias, q, k.shape[2])
    dq, dk, dv = cpu_bwd(
        g,
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        out,
        lse[..., :sq].to(q.dtype).contiguous(),
        0.0,
        causal,
        attn_mask=m,
        scale=scale,
    )
    return dq, dk, dv, None


def _cudnn(q, k, v, bias, compute_lse, dropout_p, is_causal, debug, *, scale):  # type: ignore[no-untyped-def]
    assert bias is None and compute_lse and not debug
    out, lse = cpu_fwd(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, is_causal, scale=scale)
    return out, lse.unsqueeze(-1), None, None, q.shape[2], k.shape[2], None, None, None


def _cudnn_bwd(g, q, k, v, out, lse, seed, off, bias, cq, ck, mq, mk, p, causal, *, scale):  # type: ignore[no-untyped-def]
    assert lse.shape == (*q.shape[:3], 1) and lse.is_contiguous() and bias is None
    return cpu_bwd(g, q, k, v, out, lse.squeeze(-1).to(q.dtype), 0.0, causal, scale=scale)


FAKE = SimpleNamespace(
    _scaled_dot_product_flash_attention=_flash,
    _scaled_dot_product_flash_attention_backward=_flash_bwd,
    _scaled_dot_product_efficient_attention=_eff,
    _scaled_dot_product_efficient_attention_backward=_eff_bwd,
    _scaled_dot_product_cudnn_attention=_cudnn,
    _scaled_dot_product_cudnn_attention_backward=_cudnn_bwd,
)


@pytest.fixture
def force(monkeypatch: pytest.MonkeyPatch) -> Any:
    def use(kernel: str) -> None:
        monkeypatch.setattr(kernels, "_aten", FAKE)
        monkeypatch.setattr(kernels, "_DISABLED", {})
        monkeypatch.setattr(
            kernels,
            "choose",
            lambda q, k, v, c, bias, site=None: "efficient" if bias is not None else kernel,
        )

    return use


def _inputs(s: int = 40) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    r = lambda h: torch.randn(2, h, s, 8, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    return r(4), r(2), r(2)


def _grads(out: torch.Tensor, ins: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    dout = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
    return [out.detach(), *torch.autograd.grad(out, ins, dout)]


@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn"])
@pytest.mark.parametrize("masking", ["causal", "documents", "window"])
def test_blockwise_through_the_cuda_glue(force: Any, kernel: str, masking: str) -> None:
    """A window alone is one mask for the batch ``(1, 1, sq, sk)``: the glue expands it
    to the batch and heads the kernels read."""
    force(kernel)
    q, k, v = _inputs()
    docs, window = None, None
    mask = torch.ones(40, 40, dtype=torch.bool).tril()
    if masking == "window":
        window = 9
        mask = mask & ~torch.ones(40, 40, dtype=torch.bool).tril(-window)
    if masking == "documents":
        tokens = torch.ones(2, 40, dtype=torch.long)
        tokens[0, [5, 6, 33]] = 0
        tokens[1, 20] = 0
        docs = document_ids(tokens, 0)
        mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
    want = _grads(
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), (q, k, v)
    )
    for block in (7, 16, 40):
        out, _ = blockwise_attention(
            q, k, v, causal=True, block_size=block, doc_ids=docs, window=window
        )
        for a, b in zip(_grads(out, (q, k, v)), want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert not kernels.disabled()


@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn"])
def test_ring_own_block_through_the_cuda_glue(force: Any, kernel: str) -> None:
    from plait import init_mesh
    from plait.parallel.context.ring_attention import RingAttention

    force(kernel)
    ring = RingAttention(init_mesh().axis("cp"))
    q, k, v = _inputs()
    want = _grads(
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), (q, k, v)
    )
    for a, b in zip(_grads(ring(q, k, v), (q, k, v)), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
