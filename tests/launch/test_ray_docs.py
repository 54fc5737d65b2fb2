"""docs/ray.md: every ``bash`` block is run, on the session's Ray instance.

Each block is one ``plait`` command; it runs in this process (``plait.cli.main``) in a
fresh folder, with the tiny model appended (later flags win) so that it takes seconds:
the documented flags themselves (``--ray``, restarts, checkpoints, the search, the
parameter-server mode) are exercised as written.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from plait.cli import main as plait_main
from tests.tiny import tiny_args

DOC = Path(__file__).resolve().parents[2] / "docs" / "ray.md"
TINY = {
    "train": [*tiny_args(max_bytes=100_000), "--steps", "4", "--train.checkpoint_every", "2"],
    "tune": [*tiny_args(max_bytes=100_000), "--steps", "2", "--launch.threads", "1"],
    "ps-train": ["--dim", "32", "--layers", "1", "--seq-len", "16", "--batch", "2"],
}


def _blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)


def test_every_block_is_one_plait_command_this_test_knows() -> None:
    cmds = [b.strip() for b in _blocks()]
    assert [shlex.split(c)[1] for c in cmds] == list(TINY)
    assert all(c.startswith("plait ") and "\n" not in c for c in cmds)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(TINY)))
def test_doc_block_runs(
    ray_instance: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    index: int,
) -> None:
    argv = shlex.split(_blocks()[index].strip())[1:]
    monkeypatch.chdir(tmp_path)
    assert plait_main([*argv, *TINY[argv[0]]]) == 0
    out = capsys.readouterr().out
    if argv[0] == "train":
        assert (tmp_path / "ck" / "latest").is_file()
    elif argv[0] == "tune":
        assert len(re.findall(r"^\de-3 .* done\s*$", out, re.M)) == 2, out
        assert (tmp_path / "tune-out" / "best.toml").is_file()
    else:
        assert "server 0 applied 8 update(s) from 8 gradient(s)" in out
        assert "weights ray.put per version: [1]" in out
