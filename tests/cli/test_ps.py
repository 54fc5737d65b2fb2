"""``plait ps-train``: the command end to end (fresh processes), its per-rank body on the
worker pool in every consistency model, and bad input refused with exit code 2 before
any process starts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from plait.cli import main
from plait.cli.ps import _parser, run_on_group
from plait.ps.core import PSConfig
from plait.testing import WorkerContext, WorkerPool

Pools = Callable[[int], WorkerPool]
TINY = ["--dim", "32", "--layers", "1", "--seq-len", "16", "--batch", "2"]


def _body(ctx: WorkerContext, argv: list[str]) -> str:
    args = _parser().parse_args(argv)
    cfg = PSConfig(args.servers, args.mode, args.staleness, args.steps)
    return run_on_group(args, cfg, ctx.mesh(dp=ctx.world_size).axis("dp"))


def _field(summary: str, name: str) -> str:
    m = re.search(rf"{name}: (.*)", summary)
    assert m, summary
    return m.group(1)


@pytest.mark.slow
def test_ps_train_end_to_end(tmp_path: Path) -> None:
    rec = tmp_path / "rec"
    args = ["ps-train", "--nproc", "4", "--servers", "2", "--mode", "bounded"]
    args += ["--staleness", "1", "--steps", "3", *TINY, "--records", str(rec)]
    r = subprocess.run(
        [sys.executable, "-m", "plait", *args],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "2 server(s), 2 worker(s), mode bounded (s=1)" in r.stdout
    assert "steps per worker: [3, 3]" in r.stdout
    assert "validation loss of the final weights" in r.stdout
    for s in (0, 1):  # every applied gradient of every server, staleness <= s
        rows = [json.loads(x) for x in (rec / f"server{s}.jsonl").read_text().splitlines()]
        assert len(rows) == 6 and {r["server"] for r in rows} == {s}
        assert all(0 <= r["staleness"] <= 1 for r in rows)
        assert all(r["staleness"] == r["version"] - r["read_version"] for r in rows)


def test_modes_on_the_pool(pools: Pools) -> None:
    sync = pools(3).run("tests.cli.test_ps:_body", [*TINY, "--steps", "3"])[0]
    assert "mode sync" in sync and _field(sync, "steps per worker") == "[3, 3]"
    assert _field(sync, r"staleness of applied gradients \(staleness: count\)") == "0: 6"
    # worker 1 runs 300 extra 128x128 products per step (~10x a step here): deterministic
    # extra work, nobody sleeps; fast worker 0 gets more of the 2 x 4 gradient budget
    slow = [*TINY, "--steps", "4", "--slow-worker", "1", "--slow-work", "300"]
    asy = pools(3).run("tests.cli.test_ps:_body", [*slow, "--mode", "async"])[0]
    fast, late = json.loads(_field(asy, "steps per worker"))
    assert fast + late == 8 and fast > late, asy
    assert int(_field(asy, "max staleness")) > 0
    bnd = pools(3).run("tests.cli.test_ps:_body", [*slow, "--mode", "bounded", "--staleness", "1"])
    summary = bnd[0]
    assert _field(summary, "steps per worker") == "[4, 4]"
    assert int(_field(summary, "max staleness")) <= 1
    assert json.loads(_field(summary, "replies withheld per worker"))[0] > 0


def test_a_prepared_folder_streams_to_the_workers(pools: Pools, tmp_path: Path) -> None:
    """``--data DIR``: a prepared folder, memory-mapped; each worker reads its windows."""
    import numpy as np

    from tests.data.folders import write_prepared

    tokens = np.random.default_rng(0).integers(1, 256, 6_000).astype(np.uint16)
    folder = write_prepared(tmp_path / "prepared", [tokens[:4_000], tokens[4_000:]], [3_000, 6_000])
    summary = pools(3).run(
        "tests.cli.test_ps:_body", [*TINY, "--steps", "2", "--data", str(folder)]
    )[0]
    assert _field(summary, "steps per worker") == "[2, 2]"
    assert "validation loss of the final weights" in summary


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--mode", "bounded", "--staleness", "-1"], "staleness must be >= 0"),
        (["--mode", "async", "--staleness", "2"], "needs mode='bounded'"),
        (["--nproc", "3", "--servers", "3"], "1 <= servers < world"),
        (["--steps", "0"], "steps must be >= 1"),
        (["--nproc", "3", "--slow-worker", "2"], "--slow-worker 2 (a worker index 0..1)"),
        (["--batch", "0"], "--batch 0"),
        (["--dim", "10"], "--dim 10 / --layers 2: model.dim (10) must be divisible"),
        (["--lr", "-1"], "--lr -1.0 (> 0)"),
        (["--nproc", "1"], "needs at least 2 ranks"),
        (["--data", "no/such.txt"], "--data no/such.txt: data.source 'no/such.txt' does not exist"),
    ],
)
def test_bad_input_exit_2(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ps-train", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
