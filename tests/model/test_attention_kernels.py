"""The fused-kernel layer of blockwise/ring attention on the CPU.

The CUDA kernels cannot run here; their calls are checked against the installed
torch's operator schemas on the meta device (argument count, types, the shapes of
what comes back: the efficient kernel's padded log-sum-exp rows, cuDNN's trailing 1).
The CPU kernel's forward and whole-sequence backward are checked against the
reference in float64, and the row handling under a mask (no NaN, lse = -inf)."""

from __future__ import annotations

import pytest
import torch

from plait.model import attention_kernels as kernels
from plait.model.blockwise_attention import blockwise_attention
from plait.model.document_mask import additive


@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn"])
@pytest.mark.parametrize(("sq", "sk", "causal"), [(100, 100, True), (37, 80, False)])
def test_cuda_kernel_calls_match_the_operator_schemas(
    kernel: kernels.Kernel, sq: int, sk: int, causal: bool
) -> None:
    mk = lambda s: torch.empty(2, 4, s, 128, dtype=torch.bfloat16, device="meta")  # noqa: E731
    q, k, v = mk(sq), mk(sk), mk(sk)
    out, lse = kernels.forward(kernel, q, k, v, causal, 0.1)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert lse.shape == (2, 4, sq) and lse.dtype == torch.float32
    dq, dk, dv = kernels.backward(kernel, out, q, k, v, out, lse, causal, 0.1)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_efficient_kernel_with_a_mask_on_meta() -> None:
    q = torch.empty(2, 4, 37, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 4, 21, 64, dtype=torch.bfloat16, device="meta")
    bias = torch.empty(2, 1, 37, 21, dtype=torch.float32, device="meta")
    out, lse = kernels.forward("efficient", q, k, k, False, 0.1, bias)
    assert out.shape == q.shape and lse.shape == (2, 4, 37)
    grads = kernels.backward("efficient", out, q, k, k, out, lse, False, 0.1, bias)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]


def test_choice_on_the_cpu() -> None:
    for dt, want in ((torch.float64, "cpu"), (torch.bfloat16, "cpu"), (torch.float16, None)):
        q = torch.zeros(1, 1, 2, 8, dtype=dt)
        assert kernels.choose(q, q, q, True, None) == want


def test_masked_rows_get_minus_infinity_and_zero() -> None:
    """A row that sees no key of the block: out 0, lse -inf (the CPU kernel says 0)."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    vis = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    vis[:, :, 1] = False
    out, lse = kernels.forward("cpu", q, k, k, False, 0.3, additive(vis, torch.float64))
    assert torch.isneginf(lse[:, :, 1]).all() and (out[:, :, 1] == 0).all()
    assert torch.isfinite(lse[:, :, [0, 2, 3]]).all()


@pytest.mark.parametrize("causal", [True, False])
def test_whole_sequence_fused_backward_equals_reference(causal: bool) -> None:
    """Only ``out`` used (no lse gradient): the fused path's one backward call over the
    whole sequence gives the reference's per-block gradients (float64, GQA 6:2)."""
    g = torch.Generator().manual_seed(3)
    mk = lambda h: torch.randn(2, h, 19, 8, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    q, k, v = mk(6), mk(2), mk(2)
    dout = torch.randn(2, 6, 19, 8, generator=g, dtype=torch.float64)
    grads = []
    for impl in ("fused", "reference"):
        out, _ = blockwise_attention(q, k, v, causal=causal, block_size=4, impl=impl)  # type: ignore[arg-type]
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_a_failing_kernel_is_disabled_at_its_call_site_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel that raises (an unsupported shape on some GPU, say) is reported once per
    call site and not chosen there again, the blocks are still computed exactly, and the
    calls made there afterwards are counted as fallbacks; another call site (here the
    backward, and a direct :func:`kernels.choose`) keeps the kernel."""
    monkeypatch.setattr(kernels, "_DISABLED", {})
    monkeypatch.setattr(kernels, "_FALLBACKS", {})
    real = kernels.forward

    def failing(kernel: kernels.Kernel, *args: object, **kw: object) -> object:
        if kernel == "cpu":
            raise RuntimeError("no kernel for this shape\nmore detail")
        return real(kernel, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels, "forward", failing)
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))
    q.requires_grad_()
    with pytest.warns(RuntimeWarning, match="cpu kernel failed at .*block_forward"):
        out, _ = blockwise_attention(q, k, k, causal=True, block_size=4)
    (site,) = kernels.disabled()
    assert site.endswith("blockwise_attention.block_forward"), site
    assert kernels.disabled() == {site: {"cpu": "no kernel for this shape"}}
    assert kernels.choose(q, k, k, True, None, site=site) is None
    assert kernels.choose(q, k, k, True, None) == "cpu"  # this test is another site
    # 3 query blocks of 4, 4, 1 rows: a diagonal call each, and one call over the keys
    # before it for the last two (coalesced): 5 calls, every one after the first failure
    assert kernels.fallbacks() == {site: 5}
    want = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    used: list[str] = []
    real_bwd = kernels.backward
    monkeypatch.setattr(
        kernels, "backward", lambda kn, *a, **kw: used.append(kn) or real_bwd(kn, *a, **kw)
    )
    out.sum().backward()  # the backward's own sites still run the fused kernel
    assert used and set(used) == {"cpu"}
    assert list(kernels.disabled()) == [site]
    kernels.reset()
    assert kernels.disabled() == {} and kernels.fallbacks() == {}


def test_running_out_of_memory_in_a_kernel_propagates_and_keeps_it_enabled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Out of memory is not the kernel's fault: the plain fallback would need more (full
    score blocks), so the error reaches the caller (the launcher names it) and the kernel
    is not disabled for the rest of the run."""
    monkeypatch.setattr(kernels, "_DISABLED", {})
    monkeypatch.setattr(kernels, "_FALLBACKS", {})

    def oom(kernel: kernels.Kernel, *args: object, **kw: object) -> object:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(kernels, "forward", oom)
    q = torch.randn(1, 2, 9, 8, dtype=torch.float64)
    with pytest.raises(torch.OutOfMemoryError):
        blockwise_attention(q, q, q, causal=True, block_size=4)
    assert kernels.disabled() == {}
    assert kernels.choose(q, q, q, True, None) == "cpu"
