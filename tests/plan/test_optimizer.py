"""The planner's Muon and Adafactor terms (plait.plan.optimizer, optimizer_time), by hand.

State: on a tiny model in one process, the planner's optimizer bytes equal the state the
runtime holds after one step (Muon: a float32 momentum per hidden-matrix element, AdamW's
two moments and step on the rest; Adafactor: a row and a column factor per matrix and a
step per tensor, a variance per vector element). Step time: the owners are dealt as the
runtime deals them, and Muon's extra seconds are the Newton-Schulz FLOPs of each matrix
(written out here) at the hardware's GEMM rate, plus the owner exchange under ZeRO."""

from __future__ import annotations

import random

import pytest
import torch

from plait.config import Config, ModelConfig
from plait.model import Transformer
from plait.optim import Optimizer
from plait.parallel.zero.owners import assign_owners
from plait.plan import HARDWARE_PRESETS, Layout, ModelSpec
from plait.plan.estimate import estimate
from plait.plan.layout import precision_preset, runtime_preset
from plait.plan.memory import memory_per_rank
from plait.plan.network import all_to_all_time, group
from plait.plan.optimizer import OptimizerSpec, owner_exchange_bytes
from plait.plan.optimizer_time import busiest_owner_seconds
from plait.plan.query import Query
from plait.plan.search import search
from plait.train.matrix_optim import make_adafactor, make_muon

MODEL = ModelConfig(vocab_size=32, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=16)
SPEC = ModelSpec.from_config(MODEL, "tiny")
HW = HARDWARE_PRESETS["a100-80gb"]


def _query(layout: Layout, optimizer: str) -> Query:
    return Query.of_layout(
        SPEC,
        layout,
        HW,
        precision_preset("fp32"),
        runtime_preset("plait"),
        8,
        optimizer=OptimizerSpec(optimizer),  # type: ignore[arg-type]
    )


def _runtime_state_bytes(optimizer: str) -> int:
    model = Transformer(MODEL, seed=0)
    cfg = Config()
    cfg.train.optimizer = optimizer  # type: ignore[assignment]
    make = make_muon if optimizer == "muon" else make_adafactor
    opt = Optimizer(model, make(model, cfg, 1e-3))
    x = torch.randint(0, 32, (2, 8))
    model(x).sum().backward()
    opt.step()
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())


@pytest.mark.parametrize("optimizer", ["muon", "adafactor"])
def test_state_bytes_are_the_runtimes(optimizer: str) -> None:
    layout = Layout(dp=1, tp=1, pp=1, cp=1, zero=0)
    got = memory_per_rank(_query(layout, optimizer), layout).optimizer
    # by hand: a block's matrices q (8, 8), k (4, 8), v (4, 8), o (8, 8), gate and up
    # (16, 8), down (8, 16): 576 elements, R + C = 128; 2 blocks; embedding and head
    # (32, 8) each; 40 norm elements; 21 tensors (14 matrices)
    if optimizer == "muon":
        want = 4 * 2 * 576 + 8 * (2 * 256 + 40) + 4 * (21 - 14)
    else:
        want = 4 * (2 * 128 + 2 * (32 + 8)) + 4 * 40 + 4 * 21
    assert got == want == _runtime_state_bytes(optimizer)


def test_owners_are_dealt_as_the_runtime_deals_them() -> None:
    rng = random.Random(0)
    for ranks in (2, 3, 8):
        items = [rng.randint(1, 100) for _ in range(17)]
        load = [0] * ranks
        for f, r in zip(items, assign_owners(items, ranks), strict=True):
            load[r] += f
        assert busiest_owner_seconds([float(i) for i in items], ranks) == max(load)


def _flops(m: int, n: int) -> int:
    """5 Newton-Schulz steps on an (m, n) matrix, m <= n: per step x xᵀ, gram², poly x."""
    return 5 * (2 * m * m * n + 2 * m**3 + 2 * m * m * n)


def test_muon_step_seconds() -> None:
    mats = [(8, 8), (4, 8), (4, 8), (8, 8), (8, 16), (8, 16), (8, 16)] * 2  # (min, max)
    seconds = [_flops(m, n) / HW.matmul.at((m * m * n) ** (1 / 3)) for m, n in mats]
    replicated = Layout(dp=2, tp=1, pp=1, cp=1, zero=0)
    extra = (
        estimate(_query(replicated, "muon"), replicated).time.optimizer
        - estimate(_query(replicated, "adamw"), replicated).time.optimizer
    )
    assert extra == pytest.approx(sum(seconds), rel=1e-12)  # every rank: every matrix
    zero1 = Layout(dp=2, tp=1, pp=1, cp=1, zero=1)
    extra = (
        estimate(_query(zero1, "muon"), zero1).time.optimizer
        - estimate(_query(zero1, "adamw"), zero1).time.optimizer
    )
    dp = group(zero1, HW, "dp", size=2)
    exchange = 2 * all_to_all_time(2 * 576 * 4 / 2, 2, dp.link)  # a shard in, a shard out
    assert extra == pytest.approx(busiest_owner_seconds(seconds, 2) + exchange, rel=1e-12)
    assert busiest_owner_seconds(seconds, 2) < sum(seconds)
    # bytes a rank sends: half of each matrix it does not own, both ways
    assert owner_exchange_bytes(2 * 576, 2) == 2 * (2 * 576 / 2 * 4) / 2


def test_search_ranks_with_the_optimizers_step() -> None:
    """Every layout the search ranks carries Muon's terms (the same as its own
    estimate's), and they are ranked by the step time that includes them."""
    prec, rt = precision_preset("bf16-mixed"), runtime_preset("plait")
    q = {
        name: Query(SPEC, HW, 4, 8, 8, prec, rt, optimizer=OptimizerSpec(name))  # type: ignore[arg-type]
        for name in ("adamw", "muon")
    }
    ranked = search(q["muon"], top=20).ranked
    assert len(ranked) > 1
    for e in ranked:
        assert e.time.optimizer == estimate(q["muon"], e.layout).time.optimizer
        assert e.time.optimizer > estimate(q["adamw"], e.layout).time.optimizer
    totals = [e.time.total for e in ranked]
    assert totals == sorted(totals)
