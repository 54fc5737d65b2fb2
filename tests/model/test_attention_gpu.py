"""Blockwise and ring attention on CUDA through the fused kernels (bf16), against SDPA.

GPU only (marked ``gpu``; skipped without CUDA). Each of the flash, memory-efficient
and cuDNN kernels is forced with ``torch.nn.attention.sdpa_kernel`` (skipped where the
device or torch lacks it). Tolerance: the error of blockwise attention against a
float32 reference is at most twice SDPA's own bf16 error plus 1e-3 (relative Frobenius
norm), for the output and the q/k/v gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.model import attention_kernels as kernels
from plait.model.blockwise_attention import blockwise_attention
from plait.model.document_mask import document_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
B, H, HK, S, D = 2, 16, 8, 1024, 128


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda h: torch.randn(B, h, S, D, generator=g, device="cuda")  # noqa: E731
    return r(H), r(HK), r(HK), r(H)


def _run(fn, q, k, v, dout, dtype):  # type: ignore[no-untyped-def]
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout.to(dtype))
    return [t.float() for t in (out.detach(), q.grad, k.grad, v.grad)]


def _sdpa(mask: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
    def fn(q, k, v):  # type: ignore[no-untyped-def]
        k, v = k.repeat_interleave(H // HK, 1), v.repeat_interleave(H // HK, 1)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return fn


def _close(got: list[torch.Tensor], sdpa: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert not kernels.disabled(), kernels.disabled()  # no kernel failed and fell back
    for name, a, s, r in zip(("out", "dq", "dk", "dv"), got, sdpa, ref, strict=True):
        err = float((a - r).norm() / r.norm())
        base = float((s - r).norm() / r.norm())
        assert err <= 2 * base + 1e-3, f"{name}: {err:.2e} vs SDPA bf16 {base:.2e}"


BACKENDS = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block", [128, 1024])
def test_blockwise_bf16_equals_sdpa(backend: str, block: int) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, dout = _inputs()
    ref = _run(_sdpa(), q, k, v, dout, torch.float32)
    with sdpa_kernel(getattr(SDPBackend, backend)):
        probe = q[:, :, :block].to(torch.bfloat16)
        want = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient"}.get(
            backend, "cudnn"
        )
        if kernels.choose(probe, probe, probe, True, None) != want:
            pytest.skip(f"{backend} is not available here")
        sdpa = _run(_sdpa(), q, k, v, dout, torch.bfloat16)
        got = _run(
            lambda a, b, c: blockwise_attention(a, b, c, causal=True, block_size=block)[0],
            q,
            k,
            v,
            dout,
            torch.bfloat16,
        )
    _close(got, sdpa, ref)


def test_blockwise_lse_equals_logsumexp() -> None:
    q, k, _, _ = _inputs(1)
    qb, kb = q.bfloat16(), k.bfloat16()
    _, lse = blockwise_attention(qb, kb, kb, causal=True, block_size=256)
    ke = kb.float().repeat_interleave(H // HK, 1)
    s = qb.float() @ ke.transpose(-1, -2) / D**0.5
    s = s.masked_fill(torch.ones(S, S, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=0, atol=2e-2)


def test_blockwise_with_documents_bf16_equals_masked_sdpa() -> None:
    q, k, v, dout = _inputs(2)
    tokens = torch.ones(B, S, dtype=torch.long, device="cuda")
    tokens[0, [100, 101, 600]] = 0
    tokens[1, 900] = 0
    docs = document_ids(tokens, 0)
    causal = torch.ones(S, S, device="cuda", dtype=torch.bool).tril()
    mask = (docs[:, None, :, None] == docs[:, None, None, :]) & causal
    ref = _run(_sdpa(mask), q, k, v, dout, torch.float32)
    sdpa = _run(_sdpa(mask), q, k, v, dout, torch.bfloat16)
    for block in (128, 1024):
        got = _run(
            lambda a, b, c, n=block: blockwise_attention(
                a, b, c, causal=True, block_size=n, doc_ids=docs
            )[0],
            q,
            k,
            v,
            dout,
            torch.bfloat16,
        )
        _close(got, sdpa, ref)


@pytest.mark.parametrize("documents", [False, True])
def test_ring_on_one_gpu_equals_sdpa(documents: bool) -> None:
    """RingAttention on a cp axis of one rank: its own block as one causal kernel call
    (with documents: one masked call on the efficient kernel)."""
    from plait import init_mesh
    from plait.parallel.context.ring_attention import RingAttention

    mesh = init_mesh(device="cuda")
    ring = RingAttention(mesh.axis("cp"))
    q, k, v, dout = _inputs(3)
    mask, docs = None, None
    if documents:
        tokens = torch.ones(B, S, dtype=torch.long, device="cuda")
        tokens[:, 300] = 0
        docs = document_ids(tokens, 0)
        causal = torch.ones(S, S, device="cuda", dtype=torch.bool).tril()
        mask = (docs[:, None, :, None] == docs[:, None, None, :]) & causal
    ref = _run(_sdpa(mask), q, k, v, dout, torch.float32)
    sdpa = _run(_sdpa(mask), q, k, v, dout, torch.bfloat16)
    core = ring if docs is None else (lambda a, b, c: ring(a, b, c, docs))
    _close(_run(core, q, k, v, dout, torch.bfloat16), sdpa, ref)
