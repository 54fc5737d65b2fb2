"""``plait models``: every family of the table, its features and refusals, as text and
JSON (torch-free: the table is :mod:`plait.arch.families`)."""

from __future__ import annotations

import json

import pytest

from plait.arch.families import FAMILIES, REFUSED
from plait.cli import main


def test_text_names_every_family_and_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for spec in FAMILIES.values():
        assert f"{spec.architecture}  (model.arch {spec.name}" in out
        assert all(f in out for f in spec.features)
    for r in REFUSED:
        assert f"{r.architecture}: {r.reason}" in out
    assert "DeepseekV3ForCausalLM: its multi-head latent attention" in out


def test_json_is_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert [f["arch"] for f in table["supported"]] == list(FAMILIES)
    phi3 = next(f for f in table["supported"] if f["arch"] == "phi3")
    assert phi3["fused"] == ["self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"]
    mixtral = next(f for f in table["supported"] if f["arch"] == "mixtral")
    assert (mixtral["architecture"], mixtral["experts"]) == ("MixtralForCausalLM", "mixtral")
    assert [f["experts"] for f in table["supported"] if f["experts"]] == ["mixtral", "qwen", "qwen"]
    assert {r["architecture"] for r in table["refused"]} >= {
        "DeepseekV3ForCausalLM",
        "Gemma3ForConditionalGeneration",
    }
