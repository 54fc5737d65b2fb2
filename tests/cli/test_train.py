"""`plait train` end to end, and every bad input refused with exit code 2 before any work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plait.cli import main
from plait.errors import ConfigError
from plait.launch.local import LaunchError, launch_local
from tests.tiny import read_metrics as _metrics
from tests.tiny import run_plait as _cli
from tests.tiny import tiny_args

TINY = [*tiny_args(), "--log.log_every", "1"]


def test_train_one_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.jsonl"
    code = main(["train", *TINY, "--nproc", "1", "--steps", "12", "--metrics", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "dp1" in text and "step    12" in text
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert rows[-1]["val_loss"] is not None
    assert {"lr", "grad_norm", "tokens_per_s", "mfu", "comm_bytes", "comm_seconds"} <= set(rows[0])


def test_train_two_processes_matches_one(tmp_path: Path) -> None:
    """`plait train --nproc 2` end to end: same losses as one process (fp32, rtol 1e-5)."""
    two, one = tmp_path / "two.jsonl", tmp_path / "one.jsonl"
    r = _cli(["train", *TINY, "--nproc", "2", "--steps", "6", "--metrics", str(two)], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "dp2" in r.stdout
    assert main(["train", *TINY, "--nproc", "1", "--steps", "6", "--metrics", str(one)]) == 0
    a, b = _metrics(two), _metrics(one)
    assert [x["loss"] for x in a] == pytest.approx([x["loss"] for x in b], rel=1e-5)
    # the global gradient norm before clipping: a gradient off by a constant factor
    # (which AdamW and clipping hide from the losses) changes it by that factor
    assert [x["grad_norm"] for x in a] == pytest.approx([x["grad_norm"] for x in b], rel=1e-5)
    assert all(x["comm_bytes"] > 0 for x in a)


def test_tensor_parallel_runs_match_one_process(tmp_path: Path) -> None:
    """`plait train --nproc 2 --tp 2` and `--nproc 4 --dp 2 --tp 2` (with sequence
    parallelism and ZeRO-1): the losses and clipped-gradient norms of one process (fp32,
    rtol 1e-5; gradient clipping at 1.0 is active, so the norm must span tp correctly)."""
    one = tmp_path / "one.jsonl"
    assert main(["train", *TINY, "--nproc", "1", "--steps", "4", "--metrics", str(one)]) == 0
    want = _metrics(one)
    assert want[0]["grad_norm"] > 1.0  # clipping engaged
    runs = {
        "tp2": ["--nproc", "2", "--tp", "2"],
        "dp2xtp2": [
            *["--nproc", "4", "--dp", "2", "--tp", "2", "--zero", "1"],
            *["--parallel.sequence_parallel", "true"],
        ],
    }
    for name, layout in runs.items():
        out = tmp_path / f"{name}.jsonl"
        r = _cli(["train", *TINY, *layout, "--steps", "4", "--metrics", str(out)], tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "tensor parallel tp 2" in r.stdout and r.stdout.count("step     4") == 1
        got = _metrics(out)
        for key in ("loss", "grad_norm"):
            assert [x[key] for x in got] == pytest.approx([x[key] for x in want], rel=1e-5), name


def test_same_program_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "m.jsonl"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "plait",
            "train",
            *TINY,
            "--steps",
            "3",
            "--metrics",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(_metrics(out)) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_child_failure_names_rank_and_error(tmp_path: Path) -> None:
    # bypass the parent's checks: each child refuses a CUDA device that is not there; a
    # bad input found by the ranks is reported once, as the lowest failed rank's
    # ConfigError (usually rank 0; rank 1 when the agent stopped rank 0 before its own
    # error was written, which a loaded machine can make happen)
    with pytest.raises(ConfigError, match=r"^rank ([01]): .*no CUDA device") as e:
        launch_local(2, ["train", *TINY, "--steps", "1", "--device", "cuda"])
    text = str(e.value)
    assert not isinstance(e.value, LaunchError) and text.count("rank ") == 1, text


def _bad(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(["train", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert err.startswith("plait: error: ")
    return err


def test_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "does-not-exist" in _bad(["--data", str(tmp_path / "does-not-exist")], capsys)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "empty" in _bad(["--data", str(empty)], capsys)
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[train\nsteps = 3\n")
    assert "bad.toml" in _bad(["--config", str(bad_toml)], capsys)
    assert "missing.toml" in _bad(["--config", str(tmp_path / "missing.toml")], capsys)
    assert "did you mean 'train.steps'" in _bad(["--train.setps", "3"], capsys)
    err = _bad(["--nproc", "2", "--dp", "3"], capsys)
    assert "dp=3" in err and "world size 2" in err
    err = _bad(["--nproc", "2", "--global-batch", "10", "--micro-batch", "4"], capsys)
    assert "global_batch (10)" in err and "2 x 4" in err
    err = _bad(["--nproc", "4", "--tp", "4", "--model.n_heads", "2"], capsys)
    assert "n_heads: 2 heads" in err and "tp=4" in err and "[1, 2]" in err
    assert "no_value" not in _bad(["--steps"], capsys)


def test_bad_input_in_a_fresh_process_has_no_traceback(tmp_path: Path) -> None:
    r = _cli(["train", "--data", str(tmp_path / "nothing-here")], tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "nothing-here" in r.stderr


def test_run_folder_defaults_summary_and_tensorboard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --metrics or a checkpoint folder, the run writes both under log.dir (and
    says where); the end-of-run line reports losses, time, tokens/s and the outputs;
    TensorBoard events read back with tensorboard's own reader; resuming with another
    --steps warns that the learning-rate schedule changes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, tb = tmp_path / "run", tmp_path / "tb"
    args = [*TINY, "--nproc", "1", "--log.dir", str(run), "--train.eval_every", "2"]
    extra = ["--steps", "4", "--train.checkpoint_every", "2", "--log.tensorboard", str(tb)]
    assert main(["train", *args, *extra]) == 0
    text = capsys.readouterr().out
    ckpts = run / "checkpoints"
    assert f"checkpoints go to {ckpts}" in text
    assert text.count("memory of rank 0") == 1
    assert "MFU peak log.peak_tflops = 1 TFLOP/s" in text
    rows = _metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    (summary,) = [line for line in text.splitlines() if line.startswith("plait: done:")]
    assert f"final loss {rows[-1]['loss']:.4f}" in summary
    assert f"validation loss {rows[-1]['val_loss']:.4f}" in summary
    assert "tokens/s" in summary and f"metrics {run / 'metrics.jsonl'}" in summary
    assert f"checkpoint {ckpts / 'step_00000004'}" in summary and f"tensorboard {tb}" in summary
    acc = EventAccumulator(str(tb))
    acc.Reload()
    losses = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert losses == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
    assert len(acc.Scalars("train/val_loss")) == 2

    assert main(["train", *args, "--steps", "6", "--resume"]) == 0
    text = capsys.readouterr().out
    assert "the checkpoint's run had train.steps = 4, this run has 6" in text
    assert "learning-rate schedule" in text
    assert [r["step"] for r in _metrics(run / "metrics.jsonl")] == list(range(1, 7))


def test_notes_on_truncated_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("plait " * 20_000)  # 120,000 bytes
    args = [*TINY, "--nproc", "1", "--steps", "1", "--log.dir", str(tmp_path / "r")]
    assert main(["train", *args, "--data", str(text_file), "--data.max_bytes", "50000"]) == 0
    out = capsys.readouterr().out
    assert "holds 120,000 bytes; only the first 50,000 are used (data.max_bytes" in out
    assert main(["train", *args, "--data", str(text_file), "--data.max_bytes", "0"]) == 0
    assert "only the first" not in capsys.readouterr().out


def test_top_level_typos_and_missing_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert "unknown option '--stpes'; did you mean '--steps'?" in _bad(["--stpes", "5"], capsys)
    err = _bad(["--warmup_steps", "5"], capsys)
    assert "did you mean '--train.warmup_steps'?" in err
    assert "did you mean '--config'?" in _bad(["--confg", "x.toml"], capsys)
    if not torch.cuda.is_available():
        err = _bad(["--device", "cuda", "--nproc", "2"], capsys)
        assert "launch.device is 'cuda'" in err and "sees no CUDA device" in err
