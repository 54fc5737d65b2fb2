"""Memory components against the exact bytes of real modules.

State (weights, gradients, AdamW exp_avg/exp_avg_sq/step) is read from models built on
the meta device, including a GPT-style model written here with torch modules. Saved
activations are counted with saved-tensor hooks on small CPU models (meta tensors have
no storage to tell views apart), for plait's block in fp32 without dropout.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from plait.config import ModelConfig, TrainConfig
from plait.model import Transformer
from plait.parallel.loss import cross_entropy_loss
from plait.plan.activations import embedding_activation_bytes, head_activation_bytes
from plait.plan.layout import PRECISIONS, RUNTIMES, Layout
from plait.plan.memory import layer_params_per_rank, memory_per_rank, stage_params, state_bytes
from plait.plan.modelspec import ModelSpec
from plait.plan.units import local_pieces, stage_units
from tests.plan.queries import query

FP32 = PRECISIONS["fp32"]
PLAIT = RUNTIMES["plait"]

CONFIGS = {
    "mha": ModelConfig(vocab_size=96, dim=64, n_layers=3, n_heads=4, max_seq_len=32),
    "gqa": ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64),
    "tied": ModelConfig(
        vocab_size=128, dim=48, n_layers=2, n_heads=6, n_kv_heads=3, ffn_dim=100,
        max_seq_len=40, tie_embeddings=True,
    ),
}  # fmt: skip


class GPTBlock(nn.Module):
    """Pre-LayerNorm block with biases and a 4h GELU MLP (GPT-2 shape)."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)


class GPT(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.wte = nn.Embedding(spec.vocab, spec.hidden)
        self.wpe = nn.Embedding(spec.max_positions, spec.hidden)
        self.blocks = nn.ModuleList(
            GPTBlock(spec.hidden, spec.n_heads) for _ in range(spec.n_layers)
        )
        self.ln_f = nn.LayerNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tie_embeddings:
            self.head.weight = self.wte.weight


def _adam_state_bytes(model: nn.Module) -> tuple[int, int, int]:
    """(weights, gradients, AdamW state) bytes after one step, on the meta device."""
    params = list(model.parameters())  # shared tensors once
    for p in params:
        p.grad = torch.empty_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return nbytes(params), nbytes([p.grad for p in params]), nbytes(state)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_plait_model_state_is_exact(name: str) -> None:
    cfg = CONFIGS[name]
    with torch.device("meta"):
        model = Transformer(cfg)
    spec = ModelSpec.from_config(cfg)
    weights, grads, optim = _adam_state_bytes(model)
    mem = memory_per_rank(query(spec, Layout(), FP32, PLAIT, 16), Layout())
    assert (mem.params, mem.grads, mem.master) == (weights, grads, 0)
    assert mem.optimizer == optim
    assert spec.tensor_count() == len(list(model.parameters()))
    assert mem.buffers == 0  # plait's DataParallel: .grad are views into its buckets
    copying = memory_per_rank(
        query(spec, Layout(), FP32, replace(PLAIT, grad_buckets="copy"), 16), Layout()
    )
    assert copying.buffers == grads  # a runtime whose buckets copy every gradient


@pytest.mark.parametrize("tied", [False, True])
def test_gpt_style_state_is_exact(tied: bool) -> None:
    spec = ModelSpec("gpt", 2, 48, 4, 4, 192, 100, "gpt", 32, tied)
    with torch.device("meta"):
        model = GPT(spec)
    weights, grads, optim = _adam_state_bytes(model)
    mem = memory_per_rank(query(spec, Layout(), FP32, PLAIT, 16), Layout())
    assert (mem.params, mem.grads, mem.optimizer) == (weights, grads, optim)
    assert spec.param_count() == sum(p.numel() for p in model.parameters())


def test_gpt2_preset_has_gpt2s_parameter_count() -> None:
    from plait.plan.modelspec import MODEL_SPECS

    # 124,439,808 with the 50,257-token vocabulary (Radford et al. 2019, HF's gpt2)
    assert MODEL_SPECS["gpt2-124m"].param_count() == 124_439_808


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_shards_add_up(tp: int) -> None:
    spec = ModelSpec.from_config(CONFIGS["mha"])
    h = spec.hidden
    linear_per_rank = layer_params_per_rank(spec, tp) - 2 * h  # minus replicated norms
    assert linear_per_rank * tp == spec.layer_matmul_params()
    # embedding and head split by vocabulary (padded to a multiple of tp)
    sp = stage_params(spec, Layout(tp=tp), 0)
    vocab = math.ceil(spec.vocab / tp) * h
    assert sp.params == spec.n_layers * layer_params_per_rank(spec, tp) + 2 * vocab + h


def test_pipeline_stages_partition_the_model() -> None:
    spec = ModelSpec.from_config(CONFIGS["mha"])  # 3 layers
    for pp in (1, 2, 3):
        lay = Layout(pp=pp)
        total = sum(stage_params(spec, lay, j).params for j in range(pp))
        assert total == spec.param_count()
    assert [stage_params(spec, Layout(pp=2), j).layers for j in (0, 1)] == [2, 1]


def test_zero_shards_are_ceil_divided() -> None:
    spec = ModelSpec.from_config(CONFIGS["mha"])
    n = spec.param_count()
    shard = math.ceil(n / 7)
    units = stage_units(spec, 1, 1, 0)
    assert sum(sum(u) for u in units) == n  # every parameter in exactly one unit
    for zero in (1, 2, 3):
        # the textbook count: one flat shard of ceil(N/F)
        w, g, _, o = state_bytes(n, spec.tensor_count(), Layout(dp=7, zero=zero), FP32)
        assert o == shard * 8 + 4
        assert g == (shard if zero >= 2 else n) * 4
        assert w == (shard if zero == 3 else n) * 4
        # the runtime's count: each unit padded to a multiple of 7 (at most 6 elements
        # each), one Adam step scalar per tensor piece; summed over the 7 ranks the
        # moments cover exactly the N parameters
        mem = [
            memory_per_rank(
                query(spec, Layout(dp=7, zero=zero), FP32, PLAIT, 16), Layout(dp=7, zero=zero), r
            )
            for r in range(7)
        ]
        pad = 6 * len(units)
        assert 0 <= mem[0].grads - g <= pad * 4 * (7 if zero == 1 else 1)
        scalars = [
            sum(local_pieces(u, 7, r)[0] for u in units) * 4 for r in range(7)
        ]  # fmt: skip
        assert sum(m.optimizer - s for m, s in zip(mem, scalars, strict=True)) == n * 8


def _saved_bytes(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> int:
    fixed = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in fixed:
            seen[st.data_ptr()] = st.nbytes()
        return t

    loss = cross_entropy_loss(chunk=TrainConfig().loss_chunk)  # the trainer's default loss
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss(model(tokens), targets)
    return sum(seen.values())


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(("batch", "seq"), [(2, 16), (3, 24)])
def test_saved_activations_match_the_fp32_derivation(name: str, batch: int, seq: int) -> None:
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    model = Transformer(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    targets = torch.randint(0, cfg.vocab_size, (batch, seq))
    spec = ModelSpec.from_config(cfg)
    lay = Layout(micro_batch=batch)
    mem = memory_per_rank(query(spec, lay, FP32, PLAIT, seq), lay)
    predicted = mem.activations + mem.embedding_head
    assert predicted == _saved_bytes(model, tokens, targets)
    # the pieces: n_layers blocks of (8h + 2·kv·d + 4f)·4 + (2 + a)·4 bytes per token
    per_token = (8 * cfg.dim + 2 * cfg.kv_heads * cfg.head_dim + 4 * cfg.hidden_dim) * 4
    per_token += (2 + cfg.n_heads) * 4
    assert mem.layer_activation == batch * seq * per_token
    edge = embedding_activation_bytes(query(spec, lay, FP32, PLAIT, seq), lay)
    edge += head_activation_bytes(query(spec, lay, FP32, PLAIT, seq), lay)
    assert mem.embedding_head == edge
