"""The chunked cross-entropy equals ``F.cross_entropy`` on the full logits.

Values and gradients in float64 to 1e-12 (only the summation order differs): the
replicated head for several chunk sizes (1 token, uneven, larger than the batch, 0 = all
at once), ``ignore_index`` and both reductions; the fused output projection
(:func:`linear_cross_entropy`, gradients of the hidden states and of the weight); the
vocabulary-parallel head on tp 2 (a padded vocabulary of 37 whose padding holds +50, so
a missing mask would change the loss). A memory test counts the bytes alive during the
loss's forward and backward (``LiveBytes``, the allocation counter of
``test_materialize``): chunked, the peak is the logits' gradient plus a few
``(chunk, vocab)`` float32 blocks; unchunked it holds full float32 copies.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from plait.parallel.chunked_loss import chunked_cross_entropy, linear_cross_entropy
from plait.parallel.loss import cross_entropy_loss, loss_input
from plait.parallel.tensor.loss import vocab_parallel_cross_entropy
from plait.testing import LiveBytes, WorkerContext, WorkerPool

M = "tests.parallel.test_chunked_loss"
B, S, V, IGN = 3, 7, 37, -100
TOL = {"rtol": 1e-12, "atol": 1e-12}
f64 = torch.float64


def _case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, V, generator=g, dtype=f64) * 3  # (B, S, V)
    t = torch.randint(0, V, (B, S), generator=g)
    t[0, :3] = IGN
    t[1, -1] = V - 1
    return x, t


def _reference(x: torch.Tensor, t: torch.Tensor, red: str) -> tuple[torch.Tensor, torch.Tensor]:
    full = x.clone().requires_grad_(True)
    loss = F.cross_entropy(full.reshape(-1, V), t.reshape(-1), ignore_index=IGN, reduction=red)
    loss.backward()
    assert full.grad is not None
    return loss.detach(), full.grad


@pytest.mark.parametrize("chunk", [0, 1, 4, 5, 21, 100])
@pytest.mark.parametrize("red", ["mean", "sum"])
def test_chunked_equals_cross_entropy(chunk: int, red: str) -> None:
    x, t = _case()
    want, want_g = _reference(x, t, red)
    xin = x.clone().requires_grad_(True)
    got = chunked_cross_entropy(xin, t, chunk, reduction=red)
    got.backward()
    torch.testing.assert_close(got.detach(), want, **TOL)
    torch.testing.assert_close(xin.grad, want_g, **TOL)


def test_default_loss_chunked_takes_bf16_as_is() -> None:
    """The chunked default loss takes 16-bit logits uncast and returns a 16-bit gradient;
    the unchunked one gets them cast to float32 (as before)."""
    x, t = _case(1)
    xb = x.to(torch.bfloat16).requires_grad_(True)
    fn = cross_entropy_loss(chunk=4)
    assert loss_input(fn, xb) is xb
    assert loss_input(cross_entropy_loss(), xb).dtype == torch.float32
    loss = fn(xb, t)
    loss.backward()
    assert loss.dtype == torch.float32 and xb.grad is not None
    assert xb.grad.dtype == torch.bfloat16
    want, want_g = _reference(xb.detach().double(), t, "mean")
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xb.grad.double(), want_g, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("chunk", [0, 1, 6, 64])
def test_linear_cross_entropy_equals_head_then_loss(chunk: int) -> None:
    g = torch.Generator().manual_seed(3)
    h = torch.randn(B, S, 16, generator=g, dtype=f64)
    w = torch.randn(V, 16, generator=g, dtype=f64)
    _, t = _case(3)
    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    want = F.cross_entropy((h1 @ w1.t()).reshape(-1, V), t.reshape(-1), ignore_index=IGN)
    want.backward()
    h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    got = linear_cross_entropy(h2, w2, t, chunk)
    got.backward()
    torch.testing.assert_close(got.detach(), want.detach(), **TOL)
    torch.testing.assert_close(h2.grad, h1.grad, **TOL)
    torch.testing.assert_close(w2.grad, w1.grad, **TOL)


def test_bad_chunk_refused() -> None:
    x, t = _case()
    with pytest.raises(ValueError, match="chunk"):
        chunked_cross_entropy(x, t, -1)
    with pytest.raises(ValueError, match="do not match"):
        chunked_cross_entropy(x, t[:, :3], 2)


def _body_tp(ctx: WorkerContext, chunk: int, red: str) -> dict[str, torch.Tensor]:
    g = ctx.mesh(tp=ctx.world_size).axis("tp")
    x, t = _case(2)
    vp = -(-V // g.size) * g.size
    padded = torch.cat([x, x.new_full((B, S, vp - V), 50.0)], dim=-1)
    k = vp // g.size
    local = padded[..., g.index * k : (g.index + 1) * k].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, t, g, V, IGN, reduction=red, chunk=chunk)
    loss.backward()
    assert local.grad is not None
    return {"loss": loss.detach(), "grad": local.grad}


@pytest.mark.parametrize("chunk", [0, 2, 5, 100])
def test_vocab_parallel_chunked_equals_cross_entropy(
    pools: Callable[[int], WorkerPool], chunk: int
) -> None:
    x, t = _case(2)
    for red in ("mean", "sum"):
        want, want_g = _reference(x, t, red)
        vp = -(-V // 2) * 2
        gpad = torch.cat([want_g, want_g.new_zeros(B, S, vp - V)], dim=-1)
        for r, got in enumerate(pools(2).run(f"{M}:_body_tp", chunk, red)):
            torch.testing.assert_close(got["loss"], want, **TOL)
            torch.testing.assert_close(
                got["grad"], gpad[..., r * vp // 2 : (r + 1) * vp // 2], **TOL
            )


def _peak(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, t: torch.Tensor
) -> int:
    """Peak bytes alive (beyond the inputs) during ``fn``'s forward and backward."""
    xin = x.clone().requires_grad_(True)
    with LiveBytes() as counter:
        fn(loss_input(fn, xin), t).backward()
    return counter.peak


def test_chunked_peak_is_bounded_by_the_chunk() -> None:
    n, vocab, chunk = 1024, 512, 64
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, vocab, generator=g).to(torch.bfloat16)  # (tokens, vocab) 1 MiB
    t = torch.randint(0, vocab, (n,), generator=g)
    logits = n * vocab * 2  # bf16; counted (the loss views them) like their gradient
    block = chunk * vocab * 4  # one float32 chunk
    chunked = _peak(cross_entropy_loss(chunk=chunk), x, t)
    whole = _peak(cross_entropy_loss(), x, t)
    assert chunked <= 2 * logits + 2 * block + 64 * n, (chunked, logits, block)
    assert whole >= 2 * logits + 2 * n * vocab * 4, whole  # float32 logits and softmax
    extra, extra_whole = chunked - 2 * logits, whole - 2 * logits  # beyond logits + grad
    assert extra < extra_whole / 10, (chunked, whole)
