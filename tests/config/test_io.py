"""Loading a configuration: TOML files, dotted overrides and flags, value parsing,
unknown keys with suggestions, file errors, round trips and the field docs."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from plait.config import (
    Config,
    DataConfig,
    LaunchConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from plait.config.coerce import config_from_dict, config_to_dict
from plait.config.help_text import field_docs, format_field_docs
from plait.config.overrides import SHORT_ALIASES, parse_override_flags
from plait.config.toml_io import dump_toml, load_config
from plait.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _write(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


# ----------------------------------------------------------------------------- loading


def test_defaults_without_file_or_overrides() -> None:
    assert load_config(None, []) == Config()


def test_toml_file_is_loaded(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
[model]
dim = 64
n_heads = 2
tie_embeddings = true
rope_theta = 500000        # an int for a float field is accepted

[train]
steps = 12
lr = 1e-3

[log]
metrics = "out/metrics.jsonl"
progress = "lines"
""",
    )
    cfg = load_config(path, [])
    assert cfg.model.dim == 64 and cfg.model.n_heads == 2 and cfg.model.tie_embeddings
    assert cfg.model.rope_theta == 500000.0 and isinstance(cfg.model.rope_theta, float)
    assert cfg.train.steps == 12 and cfg.train.lr == 1e-3
    assert cfg.log.metrics == "out/metrics.jsonl" and cfg.log.progress == "lines"
    assert cfg.parallel == ParallelConfig()  # untouched sections keep their defaults


def test_overrides_beat_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[train]\nsteps = 12\nseed = 3\n")
    cfg = load_config(path, ["train.steps=50", "model.n_kv_heads=2"])
    assert cfg.train.steps == 50
    assert cfg.train.seed == 3
    assert cfg.model.n_kv_heads == 2


def test_later_override_wins() -> None:
    assert load_config(None, ["train.steps=5", "train.steps=7"]).train.steps == 7


# ----------------------------------------------------------------------------- flags

ALIAS_VALUES: dict[str, tuple[str, Any]] = {
    "nproc": ("3", 3),
    "dp": ("2", 2),
    "tp": ("2", 2),
    "pp": ("2", 2),
    "cp": ("2", 2),
    "ep": ("2", 2),
    "zero": ("1", 1),
    "steps": ("50", 50),
    "global-batch": ("32", 32),
    "micro-batch": ("4", 4),
    "seq-len": ("64", 64),
    "lr": ("0.01", 0.01),
    "seed": ("7", 7),
    "data": ("corpus.txt", "corpus.txt"),
    "metrics": ("m.jsonl", "m.jsonl"),
    "device": ("cpu", "cpu"),
    "progress": ("lines", "lines"),
    "init-from": ("model.safetensors", "model.safetensors"),
    "microbatches": ("4", 4),
    "chunks": ("2", 2),
    "schedule": ("gpipe", "gpipe"),
    "zero-shard-size": ("2", 2),
    "recompute": ("full", "full"),
}


def test_alias_table_is_complete() -> None:
    assert set(ALIAS_VALUES) == set(SHORT_ALIASES)


@pytest.mark.parametrize("alias", sorted(SHORT_ALIASES))
def test_every_alias(alias: str) -> None:
    text, expected = ALIAS_VALUES[alias]
    key = SHORT_ALIASES[alias]
    for argv in ([f"--{alias}", text], [f"--{alias}={text}"]):
        overrides, rest = parse_override_flags(argv)
        assert overrides == [f"{key}={text}"] and rest == []
        section, name = key.split(".")
        assert getattr(getattr(load_config(None, overrides), section), name) == expected


def test_dotted_flags_both_forms_and_remaining_args() -> None:
    argv = ["train", "--config", "x.toml", "--train.steps", "50", "--model.dim=64", "-v"]
    overrides, rest = parse_override_flags(argv)
    assert overrides == ["train.steps=50", "model.dim=64"]
    assert rest == ["train", "--config", "x.toml", "-v"]


def test_equals_form_keeps_equals_in_value_and_negative_values() -> None:
    overrides, _ = parse_override_flags(["--data=a=b.txt", "--train.seed", "-1"])
    assert overrides == ["data.source=a=b.txt", "train.seed=-1"]
    assert load_config(None, overrides).data.source == "a=b.txt"


def test_double_dash_stops_flag_parsing() -> None:
    overrides, rest = parse_override_flags(["--steps", "5", "--", "--lr", "1"])
    assert overrides == ["train.steps=5"]
    assert rest == ["--", "--lr", "1"]


@pytest.mark.parametrize(
    "argv", [["--steps"], ["--train.steps"], ["--steps", "--lr", "0.1"], ["-x", "--dp"]]
)
def test_flag_missing_value(argv: list[str]) -> None:
    with pytest.raises(ConfigError, match="needs a value"):
        parse_override_flags(argv)


# ----------------------------------------------------------------------------- value parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("true", True),
        ("True", True),
        ("1", True),
        ("yes", True),
        ("false", False),
        ("0", False),
        ("no", False),
        ("NO", False),
    ],
)
def test_bool_parsing(text: str, expected: bool) -> None:
    assert load_config(None, [f"model.tie_embeddings={text}"]).model.tie_embeddings is expected


def test_bad_bool_names_key() -> None:
    with pytest.raises(ConfigError, match=r"model\.tie_embeddings.*bool.*'maybe'"):
        load_config(None, ["model.tie_embeddings=maybe"])


@pytest.mark.parametrize("text", ["none", "null", "None", "NULL"])
def test_none_for_optional_fields(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path, '[log]\nmetrics = "m.jsonl"\n[parallel]\ndp = 2\n')
    cfg = load_config(path, [f"log.metrics={text}", f"parallel.dp={text}"])
    assert cfg.log.metrics is None and cfg.parallel.dp is None


def test_none_is_a_plain_value_for_non_optional_fields() -> None:
    assert load_config(None, ["log.progress=none"]).log.progress == "none"
    assert load_config(None, ["data.tokenizer=byte"]).data.tokenizer == "byte"
    with pytest.raises(ConfigError, match=r"train\.steps.*int.*'none'"):
        load_config(None, ["train.steps=none"])


def test_literal_parsing() -> None:
    cfg = load_config(None, ["launch.device=cuda", "parallel.backend=gloo"])
    assert cfg.launch.device == "cuda" and cfg.parallel.backend == "gloo"
    with pytest.raises(ConfigError, match=r"^launch\.device must be auto, cpu or cuda, got 'tpu'"):
        load_config(None, ["launch.device=tpu"])
    with pytest.raises(ConfigError, match=r"data\.token_dtype must be uint16 or uint32, got"):
        config_from_dict({"data": {"token_dtype": "int8"}})


def test_numbers_from_strings() -> None:
    cfg = load_config(None, ["train.lr=2e-4", "train.steps=1_000", "log.peak_tflops=3"])
    assert cfg.train.lr == 2e-4 and cfg.train.steps == 1000 and cfg.log.peak_tflops == 3.0


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("train.steps=abc", r"train\.steps.*int.*'abc'"),
        ("train.steps=1.5", r"train\.steps.*int.*'1\.5'"),
        ("train.lr=fast", r"train\.lr.*float.*'fast'"),
        ("model.n_kv_heads=two", r"'model\.n_kv_heads' expects int or none, got 'two'"),
    ],
)
def test_override_type_errors_name_the_key(override: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"train": {"steps": "abc"}}, r"'train\.steps' expects int, got 'abc' \(str\)"),
        ({"train": {"steps": 1.5}}, r"'train\.steps' expects int, got 1\.5 \(float\)"),
        ({"train": {"steps": True}}, r"'train\.steps' expects int, got True \(bool\)"),
        ({"train": {"lr": True}}, r"'train\.lr' expects float"),
        ({"train": {"lr": "0.1"}}, r"'train\.lr' expects float"),
        ({"model": {"tie_embeddings": 1}}, r"'model\.tie_embeddings' expects bool, got 1"),
        ({"data": {"source": 5}}, r"'data\.source' expects str, got 5 \(int\)"),
        ({"train": {"steps": None}}, r"'train\.steps' expects int, got None"),
        ({"model": {"dim": {"a": 1}}}, r"'model\.dim' expects int"),
        ({"train": 5}, r"section 'train' must be a table"),
    ],
)
def test_dict_type_errors_name_the_key(data: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        config_from_dict(data)


def test_dict_accepts_none_for_optional_and_int_for_float() -> None:
    cfg = config_from_dict({"train": {"micro_batch": None, "lr": 1}})
    assert cfg.train.micro_batch is None
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)


# ----------------------------------------------------------------------------- unknown keys


def test_unknown_field_suggestion() -> None:
    with pytest.raises(
        ConfigError, match=r"^unknown config key 'train\.setps'; did you mean 'train\.steps'\?$"
    ):
        config_from_dict({"train": {"setps": 5}})


def test_unknown_section_suggestion(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown config section 'trian'; did you mean 'train'"):
        load_config(_write(tmp_path, "[trian]\nsteps = 5\n"), [])
    with pytest.raises(ConfigError, match=r"unknown config section 'steps'.*'train\.steps'"):
        config_from_dict({"steps": 5})
    with pytest.raises(ConfigError, match=r"unknown config section 'zzz'; the sections are model"):
        config_from_dict({"zzz": {}})


def test_field_in_the_wrong_section_suggests_the_right_one() -> None:
    with pytest.raises(ConfigError, match=r"'train\.dp'; did you mean 'parallel\.dp'"):
        config_from_dict({"train": {"dp": 2}})


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("train.setps=5", r"unknown config key 'train\.setps'; did you mean 'train\.steps'"),
        ("trian.steps=5", r"unknown config key 'trian\.steps'; did you mean 'train\.steps'"),
        ("model.n_head=2", r"did you mean 'model\.n_heads'"),
        ("steps=5", r"config key 'steps' must have the form section\.field"),
        ("train.steps", r"must have the form section\.field=value"),
        ("a.b.c=1", r"must have the form section\.field"),
        ("xyz.abc=1", r"unknown config key 'xyz\.abc'; the sections are model, parallel"),
    ],
)
def test_unknown_override_keys(override: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


def test_unknown_dotted_flag_reaches_the_close_match_error() -> None:
    overrides, _ = parse_override_flags(["--train.setps", "5"])
    with pytest.raises(ConfigError, match=r"did you mean 'train\.steps'"):
        load_config(None, overrides)


# ----------------------------------------------------------------------------- file errors


def test_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"config file '.*nope\.toml' does not exist"):
        load_config(path, [])


def test_invalid_toml_names_path_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "[train]\nsteps = 5\nlr = = 3\n", name="bad.toml")
    with pytest.raises(ConfigError, match=r"invalid TOML in config file '.*bad\.toml'.*line 3"):
        load_config(path, [])


def test_unreadable_file_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config file '.*'"):
        load_config(str(tmp_path), [])


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin.toml"
    path.write_bytes(b'[data]\nsource = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="not valid UTF-8"):
        load_config(str(path), [])


def test_post_init_errors_propagate_unchanged(tmp_path: Path) -> None:
    path = _write(tmp_path, "[train]\nsteps = 0\n")
    with pytest.raises(ConfigError, match=r"^train\.steps must be positive, got 0\.$"):
        load_config(path, [])


# ----------------------------------------------------------------------------- round trip


def _custom() -> Config:
    return Config(
        model=ModelConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=160, tie_embeddings=True),
        parallel=ParallelConfig(dp=2, backend="gloo", bucket_mb=0.5),
        train=TrainConfig(steps=7, micro_batch=2, lr=1.25e-7, scale_lr=True),
        data=DataConfig(source='we"ird\\path\n\té ✓\x01\x7f', tokenizer="tiktoken:gpt2"),
        log=LogConfig(metrics="m.jsonl", progress="none", peak_tflops=math.inf),
        launch=LaunchConfig(nproc=3, device="cpu", threads=1),
    )


@pytest.mark.parametrize("cfg", [Config(), _custom()], ids=["defaults", "custom"])
def test_round_trip(tmp_path: Path, cfg: Config) -> None:
    text = dump_toml(cfg)
    assert config_from_dict(tomllib.loads(text)) == cfg
    assert load_config(_write(tmp_path, text), []) == cfg


def test_to_dict_omits_none() -> None:
    data = config_to_dict(Config())
    sections = {"model", "parallel", "train", "optim", "precision", "data", "log", "launch", "lora"}
    assert set(data) == sections
    assert "dp" not in data["parallel"] and "metrics" not in data["log"]
    assert "rank" not in data["lora"]  # None: LoRA off
    assert data["train"]["steps"] == 500
    assert "n_kv_heads = " not in dump_toml(Config())
    assert "n_kv_heads = 2" in dump_toml(_custom())


# ----------------------------------------------------------------------------- docs


def test_field_docs_cover_every_field() -> None:
    rows = field_docs()
    expected = [
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(Config)
        for f in dataclasses.fields(getattr(Config(), section.name))
    ]
    assert [r[0] for r in rows] == expected
    assert all(doc for _, _, _, doc in rows)
    table = {r[0]: r for r in rows}
    assert table["train.steps"] == ("train.steps", "int", "500", "Number of optimizer steps.")
    assert table["model.n_kv_heads"][1:3] == ("int | None", "-")
    assert table["parallel.backend"][1:3] == ("auto|gloo|nccl", '"auto"')
    assert "\n" not in table["data.source"][3] and "  " not in table["data.source"][3]


@pytest.mark.parametrize("width", [80, 200])
def test_format_field_docs(width: int) -> None:
    text = format_field_docs(width)
    for section in ("model", "parallel", "train", "precision", "data", "log", "launch"):
        assert f"[{section}]" in text
    assert "[train]  Optimisation and evaluation." in text
    assert "train.global_batch" in text and "the invariant of the run" in text
    assert max(len(line) for line in text.splitlines()) <= width
