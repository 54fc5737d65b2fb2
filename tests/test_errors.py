"""Install hints name the command that works where plait was installed from."""

from __future__ import annotations

from pathlib import Path

import plait
from plait.errors import install_hint


def test_install_hint_from_a_source_checkout() -> None:
    checkout = Path(plait.__file__).resolve().parents[2]
    assert (checkout / "pyproject.toml").is_file()  # these tests run from the checkout
    hint = install_hint("tiktoken", "tiktoken")
    assert hint.startswith("`python -m pip install -e '.[tiktoken]'` in ")
    assert str(checkout) in hint and "`python -m pip install tiktoken`" in hint
