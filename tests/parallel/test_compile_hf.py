"""``train.compile`` on a model plait did not write, launched as users do: a Hugging Face
Llama folder (transformers' own decoder layers, each compiled) trained under
``torchrun --nproc-per-node 2`` at dp2 gives the losses of the eager one-process run on
the same global batches (rel 1e-4: float32, compiled kernels reorder the sums)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint.test_hf import make_hf_llama

pytest.importorskip("transformers")

RUN = [
    *["--seq-len", "16", "--global-batch", "4", "--data.max_bytes", "50000", "--steps", "3"],
    *["--train.eval_every", "0", "--progress", "lines", "--log.peak_tflops", "1"],
    *["--model.family", "hf-llama", "--launch.threads", "1"],
]


def _losses(metrics: Path) -> list[float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [float(r["loss"]) for r in rows if r.get("loss") is not None]


def _run(cmd: list[str], cwd: Path) -> str:
    r = subprocess.run(
        cmd,
        cwd=cwd,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr


def test_compiled_hf_folder_under_torchrun_matches_eager_one_process(tmp_path: Path) -> None:
    src = make_hf_llama(tmp_path / "llama", tied=False)
    base = ["--init-from", str(src), *RUN]
    eager, compiled = tmp_path / "eager.jsonl", tmp_path / "compiled.jsonl"
    _run([sys.executable, "-m", "plait", "train", *base, "--nproc", "1",
          "--metrics", str(eager)], tmp_path)  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    out = _run([*torchrun, "--nproc-per-node", "2", "-m", "plait", "train", *base, "--dp", "2",
                "--train.compile", "true", "--metrics", str(compiled)], tmp_path)  # fmt: skip
    assert "torch.compile per block" in out  # the banner: the decoder layers were compiled
    want, got = _losses(eager), _losses(compiled)
    assert len(want) == 3
    assert got == pytest.approx(want, rel=1e-4)
