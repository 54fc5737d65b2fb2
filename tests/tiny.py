"""The tiny model and run that the trainer and CLI tests share (seconds per run on CPU).

:func:`tiny_args` spells it as ``plait train`` flags, :func:`tiny_config` as a
:class:`plait.config.Config`: dim 32, 2 layers, 4 heads, sequences of 32 tokens, a
global batch of 8, a small slice of the built-in corpus, one evaluation batch.
:func:`run_plait` runs the CLI in a fresh process and :func:`read_metrics` reads the
metrics file it wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from plait.config import Config, DataConfig, LogConfig, ModelConfig, ParallelConfig, TrainConfig


def tiny_args(max_bytes: int = 200_000) -> list[str]:
    """``plait train`` flags of the tiny model and run (no evaluation, progress lines);
    callers add ``--steps``, ``--nproc`` and the layout."""
    return [
        *["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4"],
        *["--model.max_seq_len", "32", "--seq-len", "32", "--global-batch", "8"],
        *["--data.max_bytes", str(max_bytes), "--train.eval_every", "0"],
        *["--train.eval_batches", "1", "--progress", "lines", "--log.peak_tflops", "1"],
    ]


def tiny_config(
    micro_batch: int | None = None, steps: int = 4, parallel: dict[str, Any] | None = None
) -> Config:
    """The tiny run as a config: GQA (2 KV heads), warm-up 2 steps, evaluation every 2
    steps, no progress output; ``parallel`` fields go to :class:`ParallelConfig`."""
    return Config(
        model=ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32),
        parallel=ParallelConfig(**(parallel or {})),
        train=TrainConfig(
            steps=steps,
            global_batch=8,
            micro_batch=micro_batch,
            seq_len=32,
            warmup_steps=2,
            eval_every=2,
            eval_batches=1,
        ),
        data=DataConfig(max_bytes=200_000),
        log=LogConfig(progress="none", peak_tflops=1.0),
    )


def run_plait(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m plait ARGS`` in a fresh process in ``cwd`` (unbuffered output,
    captured as text; the exit code is the caller's to check)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "plait", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``--metrics`` JSONL file, in step order."""
    return [json.loads(line) for line in path.read_text().splitlines()]
