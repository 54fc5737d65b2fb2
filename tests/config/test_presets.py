"""One table of model presets: the model and the planner read the same shapes."""

from __future__ import annotations

import pytest

from plait.config import ModelConfig
from plait.config.presets import MODEL_PRESETS, PRESETS, Preset, model_preset
from plait.errors import ConfigError
from plait.plan.modelspec import MODEL_SPECS as SPECS
from plait.plan.modelspec import ModelSpec


def test_the_planner_knows_every_name_and_nothing_else() -> None:
    assert list(SPECS) == list(PRESETS)


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_a_built_in_shape_means_the_same_to_the_model_and_the_planner(name: str) -> None:
    assert SPECS[name] == ModelSpec.from_config(model_preset(name), name)


def test_the_model_builds_the_llama_shapes_only() -> None:
    assert set(MODEL_PRESETS) == {n for n, p in PRESETS.items() if p.style == "llama"}
    assert {"tiny", "small", "gpt2-124m-llama", "llama2-7b", "llama3-8b"} <= set(MODEL_PRESETS)
    assert all(SPECS[n].style == p.style for n, p in PRESETS.items())


def test_gpt2_124m_is_gpt2_small() -> None:
    """GPT-2 small (Radford et al. 2019): 12 layers, 12 heads, width 768, vocabulary
    50257, 1024 positions, output head tied to the token embedding."""
    spec = SPECS["gpt2-124m"]
    shape = (spec.n_layers, spec.n_heads, spec.hidden, spec.vocab, spec.max_positions)
    assert shape == (12, 12, 768, 50257, 1024)
    assert spec.tie_embeddings and spec.style == "gpt" and spec.ffn_hidden == 4 * 768
    assert spec.param_count() == 124_439_808


def test_model_preset_is_a_private_copy() -> None:
    assert model_preset("small") == ModelConfig()
    assert model_preset("tiny") is not MODEL_PRESETS["tiny"]
    assert model_preset("tiny") == MODEL_PRESETS["tiny"]


def test_model_preset_refuses_unknown_and_gpt_style_names() -> None:
    with pytest.raises(ConfigError, match=r"unknown model preset 'nope'; choose one of .*tiny"):
        model_preset("nope")
    with pytest.raises(ConfigError, match=r"'gpt2-124m' is a GPT-style .* use 'gpt2-124m-llama'"):
        model_preset("gpt2-124m")
    with pytest.raises(ConfigError, match=r"'gpt3-175b' is a GPT-style .* use one of"):
        model_preset("gpt3-175b")


def test_preset_style_is_checked() -> None:
    with pytest.raises(ConfigError, match="preset style must be llama or gpt, got 'bert'"):
        Preset(ModelConfig(), "bert")  # type: ignore[arg-type]
