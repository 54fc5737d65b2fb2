"""`plait train` with context parallelism: the commands of context-parallel.md (cp2
ring, cp2 Ulysses) give the losses and gradient norms of the same command on one process
(fp32, rtol 1e-5, as the other CLI parity tests), and bad cp inputs exit 2."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from plait.cli import main
from tests.tiny import read_metrics as _metrics
from tests.tiny import run_plait as _cli
from tests.tiny import tiny_args

DOC = Path(__file__).resolve().parents[2] / "docs" / "context-parallel.md"
"""Its bash block is marked ``run-by`` this file (tests/test_docs.py runs the rest)."""
TINY = [*tiny_args(), "--log.log_every", "1"]


def doc_commands() -> list[list[str]]:
    """The ``plait ...`` command lines of the docs page's console blocks, split."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    return [shlex.split(line) for b in blocks for line in b.splitlines() if line.strip()]


def _one_process(argv: list[str]) -> list[str]:
    """``argv`` without its layout flags (``--nproc``, ``--cp``, ``--parallel.cp_attention``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--nproc", "--cp", "--parallel.cp_attention"):
            skip = True
        else:
            out.append(a)
    return out


def test_doc_commands_match_one_process(tmp_path: Path) -> None:
    """The docs' commands run (exit 0) and match one process step by step. The 8-rank
    4D layouts run through the API in tests/parallel/context/test_context_parallel.py
    (a fresh 8-process CLI run costs most of a minute on the shared CI machine)."""
    commands = doc_commands()
    assert [c[:2] for c in commands] == [["plait", "train"]] * 2
    assert any("ulysses" in c for c in commands) and all("--cp" in c for c in commands)
    extra = ["--log.log_every", "1"]
    one = tmp_path / "one.jsonl"
    assert main([*_one_process(commands[0][1:]), *extra, "--metrics", str(one)]) == 0
    want = _metrics(one)
    assert _one_process(commands[0]) == _one_process(commands[1])
    for i, argv in enumerate(commands):
        out = tmp_path / f"cp{i}.jsonl"
        r = _cli([*argv[1:], *extra, "--metrics", str(out)], tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        got = _metrics(out)
        assert len(got) == len(want) == 2
        for key in ("loss", "grad_norm"):
            assert [x[key] for x in got] == pytest.approx([x[key] for x in want], rel=1e-5), argv


def _bad(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(["train", *TINY, *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("plait: error: ")
    return err


def test_bad_context_inputs_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    err = _bad(
        ["--nproc", "4", "--cp", "4", "--seq-len", "20", "--model.max_seq_len", "32"], capsys
    )
    assert "train.seq_len (20) must be divisible by 2 x cp = 8" in err
    ulysses = ["--parallel.cp_attention", "ulysses"]
    err = _bad(["--nproc", "4", "--cp", "4", *ulysses, "--seq-len", "30"], capsys)
    assert "train.seq_len (30) must be divisible by 4" in err
    err = _bad(["--nproc", "2", "--cp", "2", *ulysses, "--model.n_heads", "1"], capsys)
    assert "1 query heads (model.n_heads 1) are not divisible by 2" in err
    err = _bad(["--nproc", "2", "--cp", "2", "--parallel.cp_attention", "stripes"], capsys)
    assert "parallel.cp_attention must be ring or ulysses, got 'stripes'" in err
    err = _bad(["--model.attention", "flash"], capsys)
    assert "model.attention must be sdpa or blockwise, got 'flash'" in err
