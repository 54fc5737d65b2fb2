"""The activation model reproduces Korthikanti et al. 2022 for Megatron's GPT block."""

from __future__ import annotations

import pytest

from plait.plan.activations import block_saved, korthikanti_layer_bytes, layer_activation_bytes
from plait.plan.layout import PRECISIONS, RUNTIMES, Layout
from plait.plan.memory import in_flight, memory_per_rank
from plait.plan.modelspec import MODEL_SPECS, ModelSpec
from tests.plan.queries import query

BF16 = PRECISIONS["bf16-mixed"]
MEGATRON = RUNTIMES["megatron"]
GPT = ModelSpec("gpt", 24, 2048, 16, 16, 8192, 51200, "gpt", 2048)  # a = 16, h = 2048


def _stats_bytes(s: int, b: int, t: int, sp: bool, recompute: str) -> float:
    """fp32 mean + rstd of the two LayerNorms, which the paper leaves out."""
    if recompute == "full":
        return 0.0
    return 2 * 2 * 4 * s * b / (t if sp else 1)


TP_SP = [(1, False), (2, False), (2, True), (4, False), (4, True), (8, False), (8, True)]


@pytest.mark.parametrize(("t", "sp"), TP_SP)
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize(("s", "b"), [(2048, 1), (1024, 4)])
def test_korthikanti_table_2(t: int, sp: bool, recompute: str, s: int, b: int) -> None:
    lay = Layout(tp=t, micro_batch=b, sequence_parallel=sp, recompute=recompute)  # type: ignore[arg-type]
    got = layer_activation_bytes(query(GPT, lay, BF16, MEGATRON, s), lay)
    want = korthikanti_layer_bytes(s, b, GPT.hidden, GPT.n_heads, t, sp, recompute)
    assert got == pytest.approx(want + _stats_bytes(s, b, t, sp, recompute), rel=1e-12)


def test_korthikanti_headline_numbers() -> None:
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B shape
    assert korthikanti_layer_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert korthikanti_layer_bytes(s, b, h, a, t=8, sp=True, recompute="selective") == (
        s * b * h * 34 / 8
    )
    assert korthikanti_layer_bytes(s, b, h, a, recompute="full") == 2 * s * b * h


def test_flash_attention_keeps_no_quadratic_term() -> None:
    plait = RUNTIMES["plait"]
    assert all(x.per_token_seq == 0 for x in block_saved(GPT, plait))
    assert any(x.per_token_seq > 0 for x in block_saved(GPT, MEGATRON))


def test_pipeline_in_flight_micro_batches() -> None:
    # 1F1B: p on the first stage, one on the last; GPipe: m everywhere
    lay = Layout(pp=4, microbatches=32)
    assert [in_flight(lay, j) for j in range(4)] == [4, 3, 2, 1]
    gpipe = Layout(pp=4, microbatches=32, schedule="gpipe")
    assert [in_flight(gpipe, j) for j in range(4)] == [32] * 4
    # fewer micro-batches than stages: all of them
    assert in_flight(Layout(pp=4, microbatches=2), 0) == 2
    # interleaved: p + (p-1)/v on the first stage (Korthikanti: L·(1 + (p-1)/(p·v)))
    inter = Layout(pp=4, microbatches=32, schedule="interleaved", chunks=2)
    assert in_flight(inter, 0) == pytest.approx(4 + 3 / 2)


def test_first_stage_holds_p_micro_batches_of_its_layers() -> None:
    spec = MODEL_SPECS["gpt2-355m"]  # 24 layers
    one = memory_per_rank(query(spec, Layout(), BF16, MEGATRON, 1024), Layout())
    pipe = memory_per_rank(
        query(spec, Layout(pp=4, microbatches=8), BF16, MEGATRON, 1024),
        Layout(pp=4, microbatches=8),
    )
    assert pipe.stage == 0
    # 4 micro-batches in flight of 6 layers = the whole model's activations once
    assert pipe.activations == pytest.approx(one.activations)


def test_fused_swiglu_saves_one_mlp_tensor_less() -> None:
    import dataclasses

    spec = MODEL_SPECS["llama2-7b"]
    lay = Layout(tp=2, micro_batch=2)
    fused = RUNTIMES["megatron-flash"]
    plain = dataclasses.replace(fused, fused_swiglu=False)
    diff = layer_activation_bytes(
        query(spec, lay, BF16, plain, 1024), lay
    ) - layer_activation_bytes(query(spec, lay, BF16, fused, 1024), lay)
    assert diff == 2 * 1024 * spec.ffn_hidden / 2 * 2  # b·s·f/t elements of 2 bytes
