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
