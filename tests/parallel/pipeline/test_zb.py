"""Zero-bubble backward split on one piece: I + W equals the full backward, and W does
not run the input-gradient path again."""

from __future__ import annotations

import pytest
import torch

from plait import init_mesh
from plait.model import Transformer
from plait.parallel.pipeline.split import split_transformer
from plait.parallel.pipeline.zb import BackwardSplit
from plait.parallel.recompute import apply_recompute
from tests.parallel.pipeline.test_runtime import SEQ, model_config


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_input_then_weight_grads_equal_the_full_backward(recompute: str) -> None:
    stages = split_transformer(Transformer(model_config(), seed=3).double(), init_mesh(), 4)
    piece = stages.chunks[1]  # blocks 2-3: a middle piece, input = hidden states
    if recompute != "none":
        apply_recompute(piece, recompute)  # type: ignore[arg-type]
    params = [p for p in piece.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, SEQ, 16, generator=g, dtype=torch.float64)
    dy = torch.randn(2, SEQ, 16, generator=g, dtype=torch.float64)

    inp = x.clone().requires_grad_(True)
    want_x, *want_p = torch.autograd.grad(piece(inp), [inp, *params], dy)

    inp = x.clone().requires_grad_(True)
    mid: list[torch.Tensor] = []  # the hidden state between the piece's two blocks
    piece.layers["2"].register_forward_hook(lambda m, a, out: mid.append(out))  # type: ignore[index]
    split = BackwardSplit(piece(inp), inp, params)
    assert split._rest == []  # every weight is reached through a consumer node
    got_x = split.input_grad(dy)
    assert all(p.grad is None for p in params)  # I computed no weight gradient
    calls: list[int] = []
    mid[0].register_hook(lambda grad: calls.append(1))
    split.weight_grads()
    assert calls == []  # W did not run the input-gradient path (through ``mid``) again
    torch.testing.assert_close(got_x, want_x, rtol=1e-12, atol=1e-14)
    for p, w in zip(params, want_p, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=1e-12, atol=1e-14)


def test_weight_grads_take_the_closed_forms_and_accumulate() -> None:
    """Every consumer of a transformer piece (matmuls and RMSNorm scales) has a closed
    form; two micro-batches accumulate to the full backward's sum; the gradients keep the
    weights' layout."""
    stages = split_transformer(Transformer(model_config(), seed=3).double(), init_mesh(), 4)
    piece = stages.chunks[1]
    params = [p for p in piece.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, SEQ, 16, generator=g, dtype=torch.float64) for _ in range(2)]
    dys = [torch.randn(2, SEQ, 16, generator=g, dtype=torch.float64) for _ in range(2)]
    want = [torch.zeros_like(p) for p in params]
    for x, dy in zip(xs, dys, strict=True):
        for w, gp in zip(want, torch.autograd.grad(piece(x.requires_grad_(True)), params, dy),
                         strict=True):
            w += gp
    splits = []
    for x, dy in zip(xs, dys, strict=True):
        inp = x.detach().clone().requires_grad_(True)
        split = BackwardSplit(piece(inp), inp, params)
        kinds = {type(n).__name__: d is not None for n, _, d in split._consumers}
        assert kinds == {"MmBackward0": True, "MulBackward0": True}
        split.input_grad(dy)
        splits.append(split)
    for split in splits:  # both Ws after both Is, as the schedule defers them
        split.weight_grads()
    for p, w in zip(params, want, strict=True):
        assert p.grad is not None and p.grad.stride() == p.stride()
        torch.testing.assert_close(p.grad, w, rtol=1e-12, atol=1e-14)


class _Odd(torch.nn.Module):
    """Consumers without a closed form: a linear with bias (``AddmmBackward0``), a weight
    used twice, and a weight behind a ``tanh`` (a chain of nodes to its leaf)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.lin = torch.nn.Linear(6, 6).double()
        self.scale = torch.nn.Parameter(torch.randn(6, generator=g, dtype=torch.float64))
        self.gate = torch.nn.Parameter(torch.randn(6, generator=g, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x.reshape(-1, 6)).reshape(x.shape)  # (batch, 3, 6)
        h = h * self.scale + h * self.scale * self.scale
        return h * torch.tanh(self.gate)


def test_weight_grads_fall_back_to_autograd_for_other_consumers() -> None:
    mod = _Odd()
    params = list(mod.parameters())
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 6, generator=g, dtype=torch.float64)
    dy = torch.randn(4, 3, 6, generator=g, dtype=torch.float64)
    inp = x.clone().requires_grad_(True)
    want_x, *want_p = torch.autograd.grad(mod(inp), [inp, *params], dy)
    inp = x.clone().requires_grad_(True)
    split = BackwardSplit(mod(inp), inp, params)
    assert any(d is None for _, _, d in split._consumers)  # the generic path is exercised
    torch.testing.assert_close(split.input_grad(dy), want_x, rtol=1e-12, atol=1e-14)
    assert all(p.grad is None for p in params)
    split.weight_grads()
    for p, w in zip(params, want_p, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=1e-12, atol=1e-14)


def test_weight_grads_add_in_place_into_existing_gradients() -> None:
    """W adds into a gradient that already exists (e.g. a view into a data-parallel
    bucket) in place: the same memory, holding the old value plus the new gradient."""
    stages = split_transformer(Transformer(model_config(), seed=3).double(), init_mesh(), 4)
    piece = stages.chunks[1]
    params = [p for p in piece.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, SEQ, 16, generator=g, dtype=torch.float64)
    dy = torch.randn(2, SEQ, 16, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(piece(x.clone().requires_grad_(True)), params, dy)
    bucket = torch.randn(sum(p.numel() for p in params), generator=g, dtype=torch.float64)
    old = bucket.clone()
    views, at = [], 0
    for p in params:  # p.grad = a view into the flat bucket
        p.grad = bucket[at : at + p.numel()].view_as(p)
        views.append((at, p.numel()))
        at += p.numel()
    inp = x.clone().requires_grad_(True)
    split = BackwardSplit(piece(inp), inp, params)
    split.input_grad(dy)
    split.weight_grads()
    for p, w, (at, n) in zip(params, want, views, strict=True):
        assert p.grad is not None and p.grad.data_ptr() == bucket[at:].data_ptr()
        torch.testing.assert_close(bucket[at : at + n].view_as(p), old[at : at + n].view_as(p) + w,
                                   rtol=1e-12, atol=1e-14)
