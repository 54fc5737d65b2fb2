"""Seeing inside a step: ``log.profile`` writes a readable trace per rank with forward,
backward and collective events; ``log.memory_snapshot`` is refused on CPU (and runs on
CUDA: the ``gpu`` test); bad windows are refused with one line."""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from plait.config import LogConfig
from plait.errors import ConfigError
from plait.testing import WorkerContext, WorkerPool
from plait.train.profile import check_memory_snapshot
from plait.train.trainer import Trainer
from tests.tiny import tiny_config

M = "tests.train.test_profile"


def _body_profile(ctx: WorkerContext, folder: str, window: str) -> list[float]:
    cfg = tiny_config(steps=3)
    cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, dir=folder, profile=window))
    mesh = ctx.mesh(dp=ctx.world_size)
    return Trainer(cfg, mesh, show_progress=False).run().losses


def _names(path: Path) -> collections.Counter[str]:
    trace = json.loads(path.read_text())
    return collections.Counter(str(e.get("name", "")) for e in trace["traceEvents"])


def test_profile_window_writes_a_trace_per_rank(
    pools: Callable[[int], WorkerPool], tmp_path: Path
) -> None:
    pools(2).run(f"{M}:_body_profile", str(tmp_path), "2-2")
    for rank in range(2):
        names = _names(tmp_path / "profile" / f"rank{rank}.json")
        assert names["plait.step.2"] == 1 and names["plait.step.1"] == 0, names
        assert names["plait.forward"] >= 1 and names["plait.forward.layers.1"] >= 1, names
        assert any("Backward" in n and "autograd::engine" in n for n in names), names
        assert any(n.startswith("plait.comm.all_reduce") for n in names), names
        assert not list((tmp_path / "profile").glob(".*tmp*"))


def test_bad_window_and_cpu_snapshot_refused() -> None:
    for bad in ("3", "5-2", "0-1", "a-b", "1-2-3"):
        if bad == "3":
            assert LogConfig(profile=bad).profile == "3"  # one step
            continue
        with pytest.raises(ConfigError, match=r"log\.profile must be 'START-END'"):
            LogConfig(profile=bad)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        check_memory_snapshot(True, "cpu")
    check_memory_snapshot(False, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_snapshot_on_cuda(tmp_path: Path) -> None:
    import pickle

    from plait import init_mesh

    cfg = tiny_config(steps=3)
    cfg = dataclasses.replace(
        cfg,
        log=dataclasses.replace(cfg.log, dir=str(tmp_path), memory_snapshot=True, profile="2-3"),
        launch=dataclasses.replace(cfg.launch, device="cuda"),
    )
    Trainer(cfg, init_mesh(device="cuda"), show_progress=False).run()
    snap = pickle.loads((tmp_path / "memory" / "rank0.pickle").read_bytes())
    assert snap["segments"] and snap["device_traces"]
    names = _names(tmp_path / "profile" / "rank0.json")
    assert any(n.startswith("plait.step.") for n in names)
