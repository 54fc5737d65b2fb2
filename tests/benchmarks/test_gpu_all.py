"""``benchmarks/gpu_all.py`` (the GPU machine's one script) on the CPU: ``--dry`` runs every
row in its smallest form, records each as it ends, goes on after a failing row, skips
rows already recorded on a rerun and rows that do not fit the machine, and stops within
seconds with one line when CUDA or the torchao wheel is missing.

The dry run starts one process per row (through the session's zygote, so without a fresh
interpreter each); its rows' work is the tiny forms the other benchmark tests also run.
Stated limit: the first dry run under 600 s of wall time (it took 240-300 s on the
development machine at load average 20 on 2 cores: about 30 CPU-seconds of the rows' own
work, the imports saved by the zygote; ``benchmarks/RESULTS.md`` records its timing).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from benchmarks.gpu_rows import ROWS

from benchmarks import gpu_all

ROOT = Path(__file__).resolve().parents[2]
DRY_LIMIT_S = 600


def _gpu_all(*args: str, timeout: float = DRY_LIMIT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_all.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    """A folder with a torchao wheel this Python accepts (empty: only its name is read
    under ``--dry``)."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    (folder / "torchao-0.18.0-py3-none-any.whl").write_bytes(b"")
    return folder


def test_budgets_and_rows() -> None:
    """The budgets add up to at most 7 minutes, each call's limits fit a 600 s call, every
    row's scripts exist, and docs/gpu.md describes every row."""
    assert gpu_all.check_budgets() == []
    docs = (ROOT / "docs" / "gpu.md").read_text()
    for row in ROWS:
        for argv in (row.gpu, row.dry):
            scripts = [x for x in argv if x.endswith(".py")]
            assert all((ROOT / s).exists() for s in scripts), (row.name, scripts)
        assert f"`{row.name}`" in docs, f"docs/gpu.md does not describe the row {row.name}"
    assert [r.call for r in ROWS] == sorted(r.call for r in ROWS)


@pytest.mark.timeout(2 * DRY_LIMIT_S)
def test_dry_run_records_fails_skips_and_reruns(tmp_path: Path, wheels: Path) -> None:
    """Every row runs in its smallest form and is recorded; the row made to fail is
    recorded with its error and the next one runs; a row whose predicted host peak does
    not fit (here a 100 GB host) is skipped with the reason; a rerun runs nothing; a
    rerun with --retry-failed runs the failed row again."""
    out = tmp_path / "out"
    t0 = time.perf_counter()
    r = _gpu_all("--dry", "--out", str(out), "--wheels", str(wheels), "--host-gb", "100",
                 "--fail", "step_plait_eager")  # fmt: skip
    first_s = time.perf_counter() - t0
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    recs = {x["row"]: x for x in _records(out)}
    assert set(recs) == {"env"} | {row.name for row in ROWS}
    assert recs["step_plait_eager"]["status"] == "failed"
    assert "made to fail" in recs["step_plait_eager"]["error"]
    assert recs["offload_7b"]["status"] == "skipped"
    assert "host peak 115 GB" in recs["offload_7b"]["reason"]
    ok = [n for n, x in recs.items() if n not in ("env", "step_plait_eager", "offload_7b")]
    assert all(recs[n]["status"] == "ok" for n in ok), {n: recs[n] for n in ok}
    assert recs["step_plait_compiled"]["figures"][0]["run"] == "plait compiled"
    cores = ["SDPA", "blockwise, block 16", "blockwise, block 32", "blockwise, block whole"]
    cores.append("ring, cp 1 (own block)")
    for name, docs in (("attention", None), ("attention_documents", 20)):
        figures = recs[name]["figures"]  # attention_gpu --tiny: every core at 64 and 128
        assert [(f["sequence"], f["attention"]) for f in figures] == [
            (s, c) for s in (64, 128) for c in cores
        ]
        assert all(f["ms"] > 0 and f["documents"] == docs for f in figures)
    assert "aten::_scaled_dot_product_flash_attention(" in (out / "schemas.txt").read_text()
    table = (out / "table.md").read_text()
    assert "| step_plait_eager | failed |" in table and "| offload_7b | skipped |" in table
    assert first_s < DRY_LIMIT_S
    again = _gpu_all("--dry", "--out", str(out), "--wheels", str(wheels), timeout=60)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("not run again") == len(ROWS)
    retry = _gpu_all("--dry", "--out", str(out), "--wheels", str(wheels), "--retry-failed",
                     "--only", "step_plait_eager", timeout=120)  # fmt: skip
    assert retry.returncode == 0, retry.stdout[-2000:]
    assert _records(out)[-1]["row"] == "step_plait_eager"
    assert _records(out)[-1]["status"] == "ok"
    # on a host that fits, the offload row runs: its child's RESULT line is its figure
    other = tmp_path / "other"
    r = _gpu_all("--dry", "--out", str(other), "--wheels", str(wheels), "--only", "offload_7b")
    assert r.returncode == 0, r.stdout[-2000:]
    (offload,) = _records(other)[-1]["figures"]
    assert offload["variant"] == "after" and offload["host_peak"] > 0


def test_no_cuda_fails_fast_with_one_line(tmp_path: Path, wheels: Path) -> None:
    t0 = time.perf_counter()
    r = _gpu_all("--out", str(tmp_path), "--wheels", str(wheels), timeout=60)
    assert r.returncode == 2 and time.perf_counter() - t0 < 30
    assert r.stdout == "" and r.stderr.count("\n") == 1
    assert r.stderr.startswith("gpu_all: no CUDA device")
    assert not (tmp_path / "rows.jsonl").exists()


def test_missing_wheel_fails_fast_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "torchao-0.18.0-cp39-abi3-win_amd64.whl").write_bytes(b"")
    r = _gpu_all("--dry", "--out", str(tmp_path), "--wheels", str(tmp_path / "wheels"), timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "no torchao wheel for Python" in r.stderr and "win_amd64" in r.stderr


def test_a_skipped_gpu_test_fails_the_row_on_a_gpu(tmp_path: Path) -> None:
    """pytest's JUnit report: on a GPU machine a skip is a failure; --dry lets it pass."""
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite tests="3" failures="0" errors="0" skipped="1">'
        '<testcase name="a"><skipped message="needs CUDA"/></testcase>'
        "</testsuite></testsuites>"
    )
    problem = gpu_all.junit_problem(xml, dry=False)
    assert problem is not None and "1 of 3 GPU tests skipped" in problem
    assert "needs CUDA" in problem
    assert gpu_all.junit_problem(xml, dry=True) is None
    xml.write_text('<testsuite tests="0" failures="0" errors="0" skipped="0"/>')
    assert gpu_all.junit_problem(xml, dry=True) == "no GPU test was collected"
