"""The planner's MoE terms against the model and the dispatch code.

* total and active parameters and FLOPs per token equal :mod:`plait.model`'s, which are
  checked against a built model in ``tests/model/test_moe.py``;
* the balanced-router all-to-all bytes per layer equal the dispatch formula
  (:func:`plait.parallel.expert.ep_bytes_per_layer`, checked against the counted bytes
  in ``tests/parallel/expert/test_expert_parallel.py``) with every rank sending each
  peer the same rows;
* the ep row ``plait plan`` prints is the layout's own expert terms: the expert bytes
  :func:`moe_memory` charges (ZeRO over dp·cp/ep, worst stage), the estimate's all-to-all;
* ``plait plan`` prints the section and refuses an ep that does not divide.
"""

from __future__ import annotations

import dataclasses

import pytest

from plait.arch import flops_per_token, param_count
from plait.cli import main
from plait.config import ModelConfig
from plait.parallel.expert import ep_bytes_per_layer
from plait.plan.hardware import hardware_preset
from plait.plan.layout import PRECISIONS, RUNTIMES, Layout
from plait.plan.modelspec import ModelSpec
from plait.plan.moe import MoESpec
from plait.plan.moe_estimate import ep_row, expert_held, moe_estimate, moe_memory
from tests.plan.queries import query

CFG = ModelConfig(
    dim=64, n_layers=4, n_heads=4, moe_experts=8, moe_top_k=2, moe_every=2, moe_shared_experts=1
)


def test_counts_equal_the_model() -> None:
    dense = dataclasses.replace(CFG, moe_experts=0)
    spec = ModelSpec.from_config(dense)
    m = MoESpec.from_config(CFG)
    assert m is not None and m.moe_layers == 2
    assert spec.param_count() + m.params_delta(active=False) == param_count(CFG)
    assert spec.param_count() + m.params_delta(active=True) == param_count(CFG, active=True)
    want = flops_per_token(CFG, 32)
    assert spec.flops_per_token(32) + m.flops_delta_per_token() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_a2a_bytes_equal_the_dispatch_formula_when_balanced(ep: int) -> None:
    m = MoESpec.from_config(CFG)
    assert m is not None
    tokens, row = 64, CFG.dim * 2
    rows = tokens * CFG.moe_top_k // ep  # the same rows to every rank
    want = ep_bytes_per_layer([rows] * ep, [rows] * ep, 0, row, CFG.moe_experts, ep)
    assert m.a2a_bytes_per_layer(tokens, ep, 2) == pytest.approx(want, rel=1e-12)


def test_ep_row_is_the_layouts_expert_terms() -> None:
    m = MoESpec.from_config(CFG)
    assert m is not None
    spec = ModelSpec.from_config(dataclasses.replace(CFG, moe_experts=0))
    hw, pr, rt = hardware_preset("a100-80gb"), PRECISIONS["bf16-mixed"], RUNTIMES["plait"]
    plain = Layout(dp=4, pp=2, micro_batch=2, microbatches=4)
    rows = {}
    for ep, zero in ((1, 0), (2, 0), (4, 0), (4, 3)):
        lay = dataclasses.replace(plain, ep=ep, zero=zero)
        rows[ep, zero] = row = ep_row(query(spec, lay, pr, rt, 32, hw, moe=m), lay)
        assert row[1] == sum(expert_held(m, lay, pr))
        mem = moe_memory(query(spec, lay, pr, rt, 32, moe=m), lay)
        assert row[1] <= mem.total
        assert row[3] == pytest.approx(
            moe_estimate(query(spec, lay, pr, rt, 32, hw, moe=m), lay).time.ep_comm
        )
    # worst stage: ceil(2 MoE layers / pp 2) = 1 layer of E/ep experts; ZeRO-3 over 4/ep
    per_param = pr.param_bytes + pr.grad_bytes + pr.master_bytes + pr.optimizer_bytes
    assert rows[1, 0][1] == m.experts * m.expert_params * per_param
    assert rows[4, 0][1] == pytest.approx(rows[1, 0][1] / 4)
    assert rows[4, 3][1] == rows[4, 0][1]  # ep 4 of dp 4: one replica, nothing to shard
    lay = dataclasses.replace(plain, ep=2, zero=3)
    assert ep_row(query(spec, lay, pr, rt, 32, hw, moe=m), lay)[1] == pytest.approx(
        rows[2, 0][1] / 2
    )
    assert rows[1, 0][2] == 0 and 0 < rows[2, 0][2] < rows[4, 0][2]


def test_plan_prints_the_expert_bytes_the_total_includes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # the reviewer's case: ZeRO-3 and pp 2 (the table ignored both: more than the total)
    args = ["plan", "--model", "llama2-7b", "--devices", "16", "--dp", "8", "--pp", "2",
            "--experts", "8", "--top-k", "2", "--ep", "4", "--zero", "3"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    total_gib = float(out.split("\n  total ")[1].split("GiB")[0])
    printed_gb = float(out.rstrip().splitlines()[-1].split()[1])
    llama = ModelConfig(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, moe_experts=8)
    m = MoESpec.from_config(llama)  # llama2-7b's shape
    assert m is not None
    lay = Layout(dp=8, pp=2, zero=3, ep=4)
    want = sum(expert_held(m, lay, PRECISIONS["bf16-mixed"]))
    assert printed_gb == pytest.approx(want / 1e9, abs=1e-3)
    assert printed_gb * 1e9 <= total_gib * 2**30


def test_plan_cli(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", "llama2-7b", "--experts", "8", "--devices", "8", "--dp", "8"]
    assert main([*base, "--ep", "4"]) == 0
    out = capsys.readouterr().out
    assert "mixture of experts: 8 experts top-2" in out and "\n  4 " in out
    assert main([*base, "--ep", "3"]) == 2
    assert "--ep 3 must divide" in capsys.readouterr().err
