"""``plait train --model.factory``: a factory that cannot be imported exits with code 2
in the launching process, before any rank starts.

The runs themselves (``--model.factory`` and ``--model.family hf-llama`` on 2 ranks,
tp 2) are docs/models.md's commands, run by tests/test_models_doc.py.
"""

from __future__ import annotations

from pathlib import Path

from tests.tiny import run_plait


def test_bad_factory_exits_2_before_starting_ranks(tmp_path: Path) -> None:
    r = run_plait(["train", "--nproc", "2", "--model.factory", "nopkg.models:build"], tmp_path)
    assert r.returncode == 2
    assert "cannot import 'nopkg.models'" in r.stderr
    assert "rank" not in r.stderr  # refused in the launching process
