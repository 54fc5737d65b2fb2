"""The planner's context-parallel terms: activations ∝ s/cp; ring: cp - 1 K/V block
passes per layer forward and twice the bytes in backward, overlapped with the blocks'
attention; Ulysses: four all-to-alls per layer forward and four backward."""

from __future__ import annotations

import dataclasses

import pytest

from plait.plan.activations import layer_activation_bytes
from plait.plan.compute import attention_flops
from plait.plan.estimate import cp_layer_time
from plait.plan.hardware import PRESETS
from plait.plan.layout import PRECISIONS, RUNTIMES, Layout
from plait.plan.modelspec import ModelSpec
from plait.plan.network import all_to_all_time, group, p2p_time
from tests.plan.queries import query

SPEC = ModelSpec("gqa", 8, 1024, 16, 4, 4096, 32000, "llama", 8192)  # 16 heads, 4 KV heads
H100 = PRESETS["h100-80gb"] if "h100-80gb" in PRESETS else next(iter(PRESETS.values()))
BF16 = PRECISIONS["bf16-mixed"]
S = 8192


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_activations_scale_with_one_over_cp(cp: int) -> None:
    rt = RUNTIMES["megatron"]
    one, split = Layout(), Layout(cp=cp)
    whole = layer_activation_bytes(query(SPEC, one, BF16, rt, S), one)
    assert layer_activation_bytes(query(SPEC, split, BF16, rt, S), split) == pytest.approx(
        whole / cp
    )


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_time_is_cp_minus_one_block_passes(cp: int) -> None:
    lay = Layout(dp=1, cp=cp)
    msg = S / cp * SPEC.hidden * 2.0  # b·(s/c)·h bf16
    kv = 2 * msg / SPEC.hidden * SPEC.n_kv_heads * SPEC.head_dim
    link = group(lay, H100, "cp").link
    ring = (cp - 1) * p2p_time(kv, link)
    exposed = dataclasses.replace(H100, comm_overlap=0.0)
    assert cp_layer_time(
        query(SPEC, lay, BF16, RUNTIMES["plait"], S, exposed), lay, msg
    ) == pytest.approx(3 * ring)  # fwd + 2 bwd
    attn = attention_flops(SPEC, lay, S) / H100.attention.at(S)
    assert cp_layer_time(
        query(SPEC, lay, BF16, RUNTIMES["plait"], S, H100), lay, msg
    ) == pytest.approx(3 * max(0.0, ring - attn))
    full = Layout(dp=1, cp=cp, recompute="full")
    assert cp_layer_time(
        query(SPEC, full, BF16, RUNTIMES["plait"], S, exposed), full, msg
    ) == pytest.approx(4 * ring)


@pytest.mark.parametrize(("cp", "kv_sent"), [(2, 4), (4, 4), (8, 16)])
def test_ulysses_time_is_eight_all_to_alls(cp: int, kv_sent: int) -> None:
    """Q and the output move all 16 heads; K and V their 4 heads, or (cp 8 > 4 KV heads)
    the 16 they are repeated to."""
    lay = Layout(dp=1, cp=cp, cp_attention="ulysses")
    msg = S / cp * SPEC.hidden * 2.0
    head = msg / SPEC.hidden * SPEC.head_dim
    link = group(lay, H100, "cp").link
    a2a = 2 * all_to_all_time(head * 16, cp, link) + 2 * all_to_all_time(head * kv_sent, cp, link)
    assert cp_layer_time(
        query(SPEC, lay, BF16, RUNTIMES["plait"], S, H100), lay, msg
    ) == pytest.approx(2 * a2a)
    assert "ulysses" in lay.describe()
