"""Activation recomputation: identical gradients, fewer saved bytes.

Saved bytes are measured with saved-tensor hooks (plait.parallel.recompute.SavedActivations):
every distinct storage autograd keeps for backward, parameters and buffers excluded; the
checkpoints keep their inputs through the same hooks, so they are counted too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from plait import init_mesh
from plait.config import Config, DataConfig, LogConfig, ModelConfig, TrainConfig
from plait.model import Transformer
from plait.parallel.recompute import SavedActivations, apply_recompute
from plait.train.trainer import Trainer

VOCAB, SEQ, BATCH, DIM, HEADS, LAYERS = 32, 16, 4, 32, 4, 2


def _builtin() -> nn.Module:
    cfg = ModelConfig(
        vocab_size=VOCAB, dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=2, max_seq_len=SEQ
    )
    return Transformer(cfg, seed=0)


class EncoderLM(nn.Module):
    """torch's TransformerEncoder (nn.MultiheadAttention inside), with dropout: the
    recomputation must replay the same dropout masks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, 64, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)))  # (batch, seq, vocab)


MODELS: dict[str, Callable[[], nn.Module]] = {"builtin": _builtin, "encoder": EncoderLM}


def _run(name: str, mode: str, math_kernel: bool = False) -> tuple[int, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = MODELS[name]()
    apply_recompute(model, mode)  # type: ignore[arg-type]
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    kernel = sdpa_kernel(SDPBackend.MATH) if math_kernel else contextlib.nullcontext()
    torch.manual_seed(5)  # the dropout masks
    with kernel:
        exclude = [*model.parameters(), *model.buffers()]
        with SavedActivations(exclude) as saved:
            out = model(x)  # (batch, seq, vocab)
        out.float().pow(2).mean().backward()
    return saved.bytes, {k: p.grad.clone() for k, p in model.named_parameters()}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("name", "math_kernel"), [("builtin", False), ("builtin", True), ("encoder", False)]
)
def test_identical_gradients_and_fewer_saved_bytes(name: str, math_kernel: bool) -> None:
    runs = {m: _run(name, m, math_kernel) for m in ("none", "selective", "full")}
    none_bytes, none_grads = runs["none"]
    for mode in ("selective", "full"):
        _, grads = runs[mode]
        for k, g in none_grads.items():
            assert torch.equal(grads[k], g), (mode, k)  # bitwise identical
    sel, full = runs["selective"][0], runs["full"][0]
    assert full < sel < none_bytes, (none_bytes, sel, full)
    # full keeps only the blocks' inputs: less than a quarter here
    assert full < none_bytes / 4


def test_selective_drops_exactly_the_attention_core_state() -> None:
    """With the fused CPU kernel the attention core saves q, k, v, its output and the
    log-sum-exp; the output is shared with the output projection's input and q, k, v stay
    as the checkpoint's inputs, so selective recomputation saves exactly the log-sum-exp
    (batch·heads·seq fp32 per layer). With the math kernel it also drops the softmax
    probabilities and scores: at least batch·heads·seq² fp32 per layer."""
    none_flash, sel_flash = _run("builtin", "none")[0], _run("builtin", "selective")[0]
    assert none_flash - sel_flash == LAYERS * BATCH * HEADS * SEQ * 4
    none_math = _run("builtin", "none", math_kernel=True)[0]
    sel_math = _run("builtin", "selective", math_kernel=True)[0]
    assert none_math - sel_math >= LAYERS * BATCH * HEADS * SEQ * SEQ * 4
    assert sel_math == sel_flash  # recomputed cores keep the same inputs either way


def test_apply_recompute_names_blocks_and_can_be_undone() -> None:
    model = _builtin()
    assert apply_recompute(model, "full") == ["layers.0", "layers.1"]
    assert all(getattr(b, "_plait_recompute", None) == "full" for b in model.layers)
    apply_recompute(model, "none")
    assert all("forward" not in b.__dict__ for b in model.layers)
    with pytest.raises(ValueError, match="no block"):
        apply_recompute(nn.Linear(2, 2), "full")
    with pytest.raises(ValueError, match="none, selective or full"):
        apply_recompute(model, "some")  # type: ignore[arg-type]
    # no recomputation (and no checkpoint) under no_grad
    apply_recompute(model, "full")
    with torch.no_grad(), SavedActivations() as saved:
        model(torch.zeros(1, 4, dtype=torch.long))
    assert saved.bytes == 0


def _tiny(recompute: str) -> Config:
    return Config(
        model=ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16),
        train=TrainConfig(
            steps=3, global_batch=4, seq_len=16, eval_every=0, eval_batches=1, recompute=recompute
        ),  # type: ignore[arg-type]
        data=DataConfig(max_bytes=100_000),
        log=LogConfig(progress="none", peak_tflops=1.0),
    )


@pytest.fixture(scope="module")
def no_recompute() -> list[float]:
    return Trainer(_tiny("none"), init_mesh(), show_progress=False).run().losses


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_trainer_with_recompute_gives_the_same_losses(mode: str, no_recompute: Any) -> None:
    got = Trainer(_tiny(mode), init_mesh(), show_progress=False).run().losses
    assert got == no_recompute  # bitwise: the recomputation replays the same operations
