"""Building the run's model: factory paths, the Hugging Face Llama, their refusals."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from plait.cli import main
from plait.config import Config, ModelConfig, ParallelConfig, TrainConfig
from plait.errors import ConfigError
from plait.model import Transformer
from plait.model.factory import build_model, load_factory, logits_of, model_params
from plait.parallel.checks import validate_run
from tests.model.factory_models import TinyGPT

TINY = {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 16}


def test_factory_is_called_with_the_model_config_after_seeding() -> None:
    cfg = ModelConfig(**TINY, factory="tests.model.factory_models:build")
    a, b = build_model(cfg, seed=5), build_model(cfg, seed=5)
    assert isinstance(a, TinyGPT) and a.wte.num_embeddings == 64
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), n  # the same seed, the same weights on every rank
    c = build_model(cfg, seed=6)
    assert not torch.equal(a.head.weight, c.head.weight)
    assert model_params(a, cfg) == sum(p.numel() for p in a.parameters())


def test_builtin_is_the_default() -> None:
    cfg = ModelConfig(**TINY)
    model = build_model(cfg, seed=1)
    assert isinstance(model, Transformer)
    assert torch.equal(model.output.weight, Transformer(cfg, seed=1).output.weight)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("tests.model.factory_models", r"must be 'package\.module:function'"),
        ("nopkg.models:build", r"cannot import 'nopkg\.models'"),
        ("tests.model.factory_models:nope", "has no attribute 'nope'"),
        ("tests.model.factory_models:TP_PLAN", "is not callable"),
    ],
)
def test_bad_factories_are_refused(path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_factory(path)


def test_factory_config_field_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"package\.module:function"):
        ModelConfig(factory="no_colon")
    with pytest.raises(ConfigError, match=r"model\.family must be plait, hf or hf-llama"):
        ModelConfig(family="gpt2")  # type: ignore[arg-type]


def test_factory_returning_no_module_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "badfactory.py").write_text("def build(cfg):\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"returned int, not an nn\.Module"):
        build_model(ModelConfig(factory="badfactory:build"), seed=0)


def test_factory_module_in_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `plait` console script's sys.path lacks the current folder; it is searched."""
    (tmp_path / "cwdmodels.py").write_text("def build(cfg):\n    return None\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert callable(load_factory("cwdmodels:build"))


def test_logits_of_outputs() -> None:
    t = torch.zeros(2, 3, 5)
    assert logits_of(t) is t
    assert logits_of(SimpleNamespace(logits=t, loss=None)) is t
    assert logits_of((t, "cache")) is t
    with pytest.raises(TypeError, match="needs logits"):
        logits_of({"x": 1})


def test_hf_llama_from_the_size_fields() -> None:
    pytest.importorskip("transformers")
    cfg = ModelConfig(
        **TINY, n_kv_heads=2, ffn_dim=48, rope_theta=500.0, norm_eps=1e-6, family="hf-llama"
    )
    model = build_model(cfg, seed=0)
    c = model.config  # type: ignore[union-attr]
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (64, 32, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == (4, 2, 48)
    assert (c.max_position_embeddings, c.rms_norm_eps, c.use_cache) == (16, 1e-6, False)
    assert c.rope_parameters["rope_theta"] == 500.0
    out = model(torch.randint(0, 64, (2, 8)))
    assert logits_of(out).shape == (2, 8, 64)
    assert isinstance(model, nn.Module)


def test_hf_llama_without_transformers_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    with pytest.raises(ConfigError, match=r"needs Hugging Face transformers.*\[hf\]"):
        build_model(ModelConfig(family="hf-llama"), seed=0)
    assert main(["train", "--model.family", "hf-llama"]) == 2
    err = capsys.readouterr().err
    assert "pip install" in err and "[hf]" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("parallel", "world", "what"),
    [
        ({"pp": 2}, 2, "pipeline parallelism"),
        ({"cp": 2}, 2, "context parallelism"),
        ({"tp": 2, "sequence_parallel": True}, 2, "sequence parallelism"),
    ],
)
def test_hf_llama_refuses_what_it_cannot_take(
    parallel: dict[str, object], world: int, what: str
) -> None:
    pytest.importorskip("transformers")
    cfg = Config(
        model=ModelConfig(dim=32, n_layers=2, n_heads=4, max_seq_len=32, family="hf-llama"),
        parallel=ParallelConfig(**parallel),  # type: ignore[arg-type]
        train=TrainConfig(global_batch=8, seq_len=32),
    )
    with pytest.raises(ConfigError, match=f"{what}.*LlamaForCausalLM"):
        validate_run(cfg, world)
