"""The planner's MoE terms against the model and the dispatch code.

* total and active parameters and FLOPs per token equal :mod:`plait.model`'s, which are
  checked against a built model in ``tests/model/test_moe.py``;
* the balanced-router all-to-all bytes per layer equal the dispatch formula
  (:func:`plait.parallel.expert.ep_bytes_per_layer`, checked against the counted bytes
  in ``tests/parallel/expert/test_expert_parallel.py``) with every rank sending each
  peer the same rows;
* the ep table: memory falls as 1/ep, only the ep that divide the ranks and experts;
* ``plait plan`` prints the section and refuses an ep that does not divide.
"""

from __future__ import annotations

import dataclasses

import pytest

from plait.cli import main
from plait.config import ModelConfig
from plait.model.transformer import flops_per_token, param_count
from plait.parallel.expert import ep_bytes_per_layer
from plait.plan.modelspec import ModelSpec
from plait.plan.moe import MoESpec, ep_table

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


def test_ep_table() -> None:
    m = MoESpec.from_config(CFG)
    assert m is not None
    rows = ep_table(m, 12, 128, 2, 16.0, 1e-5, 1e11)
    assert [r[0] for r in rows] == [1, 2, 4]  # divide both 12 ranks and 8 experts
    assert rows[0][1] == pytest.approx(m.routed_params * 16.0)
    assert rows[2][1] == pytest.approx(rows[0][1] / 4)
    assert rows[0][2] == 0 and 0 < rows[1][2] < rows[2][2]


def test_plan_cli(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", "llama2-7b", "--experts", "8", "--devices", "8", "--dp", "8"]
    assert main([*base, "--ep", "4"]) == 0
    out = capsys.readouterr().out
    assert "mixture of experts: 8 experts top-2" in out and "\n  4 " in out
    assert main([*base, "--ep", "3"]) == 2
    assert "--ep 3 must divide" in capsys.readouterr().err
