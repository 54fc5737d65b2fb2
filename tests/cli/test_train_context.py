"""`plait train` with context parallelism: the losses and gradient norms of one process
(fp32, rtol 1e-5, as the other CLI parity tests), and bad cp inputs exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.cli import main
from tests.tiny import read_metrics as _metrics
from tests.tiny import run_plait as _cli
from tests.tiny import tiny_args

TINY = [*tiny_args(), "--log.log_every", "1"]


def test_context_parallel_runs_match_one_process(tmp_path: Path) -> None:
    """cp2 ring and cp2 Ulysses (2 ranks each; the 8-rank 4D layouts run through the API
    in tests/parallel/context/test_context_parallel.py: a fresh 8-process CLI run costs
    most of a minute on the shared CI machine)."""
    one = tmp_path / "one.jsonl"
    assert main(["train", *TINY, "--nproc", "1", "--steps", "3", "--metrics", str(one)]) == 0
    want = _metrics(one)
    runs = {
        "cp2-ring": ["--nproc", "2", "--cp", "2"],
        "cp2-ulysses": ["--nproc", "2", "--cp", "2", "--parallel.cp_attention", "ulysses"],
    }
    for name, layout in runs.items():
        out = tmp_path / f"{name}.jsonl"
        r = _cli(["train", *TINY, *layout, "--steps", "3", "--metrics", str(out)], tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "cp2" in r.stdout, r.stdout
        got = _metrics(out)
        for key in ("loss", "grad_norm"):
            assert [x[key] for x in got] == pytest.approx([x[key] for x in want], rel=1e-5), name


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
    assert "parallel.cp_attention' must be one of ring, ulysses" in err
    assert "one of sdpa, blockwise" in _bad(["--model.attention", "flash"], capsys)
