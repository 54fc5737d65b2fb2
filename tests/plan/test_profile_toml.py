"""The measured grids and fixed costs of a profile survive its TOML file, and bad values
are refused with the field named (:mod:`plait.plan.profile_toml`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from plait.errors import ConfigError
from plait.plan.hardware import GRID_FIELDS, PRESETS
from plait.plan.profile_toml import dump_hardware, load_hardware

GRID = ((64.0, 256.0, 1.25), (64.0, 2048.0, 0.75), (256.0, 256.0, 1.5), (256.0, 2048.0, 1.0))


@pytest.mark.parametrize("key", GRID_FIELDS)
def test_grid_round_trips_and_is_checked(tmp_path: Path, key: str) -> None:
    hw = dataclasses.replace(PRESETS["a100-80gb"], pp_action_per_work=0.15, **{key: GRID})
    path = tmp_path / "hw.toml"
    path.write_text(dump_hardware(hw), encoding="utf-8")
    assert load_hardware(str(path)) == hw
    with pytest.raises(ConfigError, match=f"{key} must be a full grid"):
        dataclasses.replace(hw, **{key: GRID[:3]})
    with pytest.raises(ConfigError, match=f"{key} needs distinct positive"):
        dataclasses.replace(hw, **{key: ((64.0, 256.0, 0.0),)})
    path.write_text(dump_hardware(hw).replace(f"\n{key} = [", f"\n{key} = [7, "), encoding="utf-8")
    with pytest.raises(ConfigError, match=f"device.{key} must be a list"):
        load_hardware(str(path))
