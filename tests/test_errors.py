"""Install hints name the command that works where plait was installed from; the
unused-parameter refusal names the parameters and what to do, in one wording."""

from __future__ import annotations

from pathlib import Path

import plait
from plait.errors import PlaitError, UnusedParametersError, install_hint


def test_install_hint_from_a_source_checkout() -> None:
    checkout = Path(plait.__file__).resolve().parents[2]
    assert (checkout / "pyproject.toml").is_file()  # these tests run from the checkout
    hint = install_hint("tiktoken", "tiktoken")
    assert hint.startswith("`python -m pip install -e '.[tiktoken]'` in ")
    assert str(checkout) in hint and "`python -m pip install tiktoken`" in hint


def test_unused_parameters_error_names_the_parameters_and_the_remedies() -> None:
    e = UnusedParametersError(["spare.weight", "spare.bias"])
    assert isinstance(e, PlaitError) and isinstance(e, RuntimeError)  # exit code 1
    assert e.names == ["spare.weight", "spare.bias"]
    msg = str(e)
    assert msg.startswith("2 parameter(s) received no gradient")
    assert "spare.weight, spare.bias." in msg
    assert "find_unused_parameters=True" in msg and "requires_grad=False" in msg


def test_unused_parameters_error_lists_ten_names_at_most() -> None:
    names = [f"layers.{i}.weight" for i in range(12)]
    msg = str(UnusedParametersError(names))
    assert msg.startswith("12 parameter(s)")
    assert "layers.9.weight ..." in msg and "layers.10.weight" not in msg


def test_data_parallel_and_zero_raise_the_one_error() -> None:
    from plait.parallel import data_parallel
    from plait.parallel.zero import reducer

    dp_error = data_parallel.UnusedParametersError
    assert dp_error is reducer.UnusedParametersError is UnusedParametersError
