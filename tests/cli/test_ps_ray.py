"""``plait ps-train --ray``: the command's Ray path (servers and workers as actors) on the
session's Ray instance, asynchronous mode, and its summary (the gloo version's fields
plus the puts per weight version)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from plait.cli.ps import _parser, run_on_ray
from plait.ps.server import PSConfig


@pytest.mark.slow
def test_ps_train_on_ray_async(ray_instance: Path, tmp_path: Path) -> None:
    argv = ["--ray", "--nproc", "3", "--mode", "async", "--steps", "2", "--dim", "32"]
    argv += ["--layers", "1", "--seq-len", "16", "--batch", "2", "--records", str(tmp_path)]
    args = _parser().parse_args(argv)
    assert args.backend == "ray"
    cfg = PSConfig(args.servers, args.mode, args.staleness, args.steps)
    summary = run_on_ray(args, cfg, workers=2)
    assert "server 0 applied 4 update(s) from 4 gradient(s)" in summary
    steps = [
        int(s) for s in re.findall(r"\d+", summary.split("steps per worker: ")[1].split("\n")[0])
    ]
    assert sum(steps) == 4  # steps x workers gradients in total, fast workers do more
    assert "weights ray.put per version: [1]" in summary
    assert len((tmp_path / "server0.jsonl").read_text().splitlines()) == 4
