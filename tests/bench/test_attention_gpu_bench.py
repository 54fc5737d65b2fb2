"""``benchmarks/attention_gpu.py --tiny`` runs on the CPU and prints its whole table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_attention_benchmark_tiny_runs() -> None:
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "attention_gpu.py"),
            "--tiny",
            "--documents",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines() if line.startswith("| ")]
    names = [c[1].strip() for c in rows[1:]]
    want = ["SDPA", "blockwise, block 16", "blockwise, block 32", "blockwise, block whole"]
    want.append("ring, cp 1 (own block)")
    assert names == want * 2
    assert [c[0].strip() for c in rows[1:]] == ["64"] * 5 + ["128"] * 5
    for c in rows[1:]:
        assert float(c[2]) > 0 and float(c[3]) > 0
    assert "documents of 20 tokens" in r.stdout
