"""LoRA's tensor-parallel traffic and its refusals.

Traffic: under tp2 the only collectives LoRA adds are the all-reduces of the replicated
factors' gradients (column-parallel layers: A, ``rank·in``; row-parallel: B,
``out·rank``), one per adapted layer and backward pass. Measured through
``plait.comm``'s counters: a step at rank 8 and one at rank 4 make the same number of
tp all-reduces, and their bus bytes differ by exactly the formula's bytes of a rank-4
adapter set, ``Σ_layers 2(t-1)/t · 4 · d_replicated · 8 bytes`` (float64); and a
LoRA step moves no more activation bytes over tp than a full fine-tuning step of the
same model (no activation-sized collective is added).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from plait.config import LoraConfig, ModelConfig
from plait.errors import ConfigError
from plait.testing import WorkerContext, WorkerPool
from tests.tiny import run_plait, tiny_args

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=8)


def _body(ctx: WorkerContext, rank: int | None) -> dict[str, float]:
    import torch

    from plait.model import Transformer
    from plait.parallel.parallelize import parallelize

    mesh = ctx.mesh(dp=1, tp=2)
    lora = LoraConfig(rank=rank, alpha=8.0) if rank else None
    pm = parallelize(Transformer(CFG, seed=0).double(), mesh, lora=lora)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    pm.step(x, x)  # warm: the counters see one whole step below
    mesh.stats.reset()
    pm.step(x, x)
    s = mesh.stats.get("tp", "all_reduce")
    return {"calls": s.calls, "bytes": s.bytes}


def _replicated_factor_elements(rank: int) -> int:
    """Σ over one block's adapted layers of the replicated factor's elements: A
    ``rank·dim`` of each column-parallel layer (q, k, v, gate, up), B ``dim·rank`` of
    each row-parallel one (o, down)."""
    return 5 * rank * CFG.dim + 2 * CFG.dim * rank


def test_tp2_traffic_equals_the_formula(pools: Callable[[int], WorkerPool]) -> None:
    pool = pools(2)
    full, r4, r8 = (pool.run(_body, r)[0] for r in (None, 4, 8))
    assert r8["calls"] == r4["calls"]
    per_block = _replicated_factor_elements(4)
    formula = CFG.n_layers * 2 * (2 - 1) / 2 * per_block * 8  # bus bytes, float64
    assert r8["bytes"] - r4["bytes"] == formula
    adapters = CFG.n_layers * 7  # one all-reduce per adapted layer
    assert 0 < r4["calls"] - adapters <= full["calls"]  # the rest: activations
    assert 0 < r4["bytes"] - formula <= full["bytes"]  # rank 4's own factor bytes: formula


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora.rank", "0"], "lora.rank must be >= 1"),
        (["--lora.rank", "4", "--lora.targets", "q,qkv"], "lora.targets: 'qkv' matches no layer"),
    ],
)
def test_bad_lora_input_exits_2_with_one_line(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    r = run_plait(["train", *tiny_args(), "--steps", "1", *flags], tmp_path)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_target_no_layer_of_the_model_has_is_refused() -> None:
    """A model without the named layers (a user's own): ConfigError naming the target."""
    import torch

    from plait.parallel.lora import apply_lora

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="'q' matches no linear layer of Sequential"):
        apply_lora(model, LoraConfig(rank=2, targets="q"), seed=0)
