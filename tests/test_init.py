"""The package root imports lazily: ``import plait`` costs nothing, every public name
still resolves on first use."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

import plait


def test_import_plait_imports_no_torch_and_no_submodule() -> None:
    code = (
        "import sys, plait\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('torch', 'plait.')))\n"
        "assert not loaded, loaded\n"
        "assert plait.__version__\n"
        "plait.ConfigError, plait.Config, plait.load_config\n"
        "assert 'torch' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("name", sorted(set(plait.__all__) - {"__version__"}))
def test_every_public_name_resolves(name: str) -> None:
    value = getattr(plait, name)
    if name in ("comm", "optim"):
        assert isinstance(value, types.ModuleType) and value.__name__ == f"plait.{name}"
    elif name != "AXES":  # classes and functions (AXES is a tuple)
        assert value.__name__ == name and value.__module__.startswith("plait.")


def test_names_come_from_their_modules() -> None:
    from plait.config import Config
    from plait.parallel.model import ParallelModel
    from plait.parallel.parallelize import parallelize

    assert plait.Config is Config
    assert plait.ParallelModel is ParallelModel and plait.parallelize is parallelize
    assert plait.AXES == ("pp", "dp", "cp", "tp")


def test_dir_lists_the_public_names_and_unknown_names_are_refused() -> None:
    assert set(plait.__all__) <= set(dir(plait))
    assert plait.model.__name__ == "plait.model"  # a subpackage asked for as an attribute
    with pytest.raises(AttributeError, match="module 'plait' has no attribute 'nope'"):
        plait.nope  # noqa: B018
    assert not hasattr(plait, "_private")
