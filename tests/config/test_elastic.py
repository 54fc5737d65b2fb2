"""The elastic run's settings: ``--nproc MIN:MAX``, ``launch.layouts``, the 'auto'
checkpoint intervals, and their refusals (one line each)."""

from __future__ import annotations

import pytest

from plait.config import Config, TrainConfig
from plait.config.coerce import config_from_dict
from plait.config.overrides import apply_override
from plait.config.rules.elastic import (
    check_memory_checkpoints,
    layout_name,
    parse_layout_name,
    parse_nproc_range,
)
from plait.errors import ConfigError


def _cfg(*overrides: str) -> Config:
    data: dict[str, object] = {}
    for o in overrides:
        apply_override(data, o)
    return config_from_dict(data)


def test_nproc_min_max() -> None:
    cfg = _cfg("launch.nproc=2:4")
    assert (cfg.launch.min_ranks, cfg.launch.nproc) == (2, 4)
    assert _cfg("launch.nproc=4").launch.min_ranks is None
    with pytest.raises(ConfigError, match=r"MIN > MAX \(4:2\).*write 2:4"):
        parse_nproc_range("4:2")
    with pytest.raises(ConfigError, match="N or MIN:MAX"):
        parse_nproc_range("2:x")


def test_start_ranks_between_min_and_max() -> None:
    assert _cfg("launch.nproc=2:4", "launch.start_ranks=3").launch.start_ranks == 3
    with pytest.raises(ConfigError, match=r"start_ranks = 5 must be between MIN and MAX of .* 2:4"):
        _cfg("launch.nproc=2:4", "launch.start_ranks=5")
    with pytest.raises(ConfigError, match="give the range with --nproc MIN:MAX"):
        _cfg("launch.nproc=4", "launch.start_ranks=2")


def test_auto_intervals_parse() -> None:
    cfg = _cfg(
        "train.checkpoint_every=auto", "train.memory_checkpoint_every=3", "train.checkpoint_dir=c"
    )
    assert cfg.train.checkpoint_every == "auto"
    assert cfg.train.memory_checkpoint_every == 3
    with pytest.raises(ConfigError, match=r"expects int\|auto, got 'often'"):
        _cfg("train.checkpoint_every=often")
    with pytest.raises(ConfigError, match=r"expects int\|auto, got 'sometimes'"):
        config_from_dict({"train": {"memory_checkpoint_every": "sometimes"}})
    with pytest.raises(ConfigError, match="a number of steps or 'auto', got 'often'"):
        TrainConfig(memory_checkpoint_every="often")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must not be negative, got -1"):
        TrainConfig(checkpoint_every=-1)


def test_memory_copies_need_two_ranks() -> None:
    check_memory_checkpoints(2, 2)
    check_memory_checkpoints(0, 1)
    with pytest.raises(ConfigError, match="this run has one rank"):
        check_memory_checkpoints(2, 1)


def test_layout_names() -> None:
    assert parse_layout_name("tp2xdp2") == {"dp": 2, "tp": 2, "pp": 1, "cp": 1}
    assert layout_name(parse_layout_name("dp3xpp2")) == "pp2xdp3"
    for bad in ("tp2xtp2", "dp0", "ep2", "dp"):
        with pytest.raises(ConfigError, match="not a layout name"):
            parse_layout_name(bad)
    with pytest.raises(ConfigError, match="not a layout name"):
        _cfg("launch.layouts=dp2,xx4")
