"""``benchmarks/gpu_step.py --device cpu --tiny`` (docs/gpu.md's command) runs and prints
its table: a row per run with tokens/s and a finite loss; rows this plait cannot run are
listed as skipped, with the reason."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_step_tiny_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    rows = "plait eager,plain eager,plait compiled + float8"
    cmd = [
        sys.executable,
        "benchmarks/gpu_step.py",
        "--device",
        "cpu",
        "--tiny",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--peak-tflops",
        "1",
        "--rows",
        rows,
        "--json",
        str(out),
    ]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stderr
    assert "| run | tokens/s | MFU | peak memory GiB | loss after N steps |" in r.stdout
    got = {row["run"]: row for row in json.loads(out.read_text())["rows"]}
    for name in ("plait eager", "plain eager"):
        assert got[name]["tokens_per_s"] > 0 and math.isfinite(got[name]["loss"])
    assert "skipped" in got["plait compiled + float8"]  # no float8 on a CPU
    # same model, seed, batch and optimizer settings: the first step's loss agrees
    assert abs(got["plait eager"]["loss"] - got["plain eager"]["loss"]) < 1e-4
